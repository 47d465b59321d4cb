"""Methods mixed into every vLLM worker (``worker_extension_cls``); the engine calls them by name.

They run inside the worker process that owns the model shard, so tensors never cross an RPC: only bucket
handles do (see :mod:`mcore_rl.rollout.transport`).

A weight update is vLLM's in-place layer-wise reload (``reload_weights``) split into its three phases, held open
across buckets: vLLM processes a layer (fuses, repacks) once all of its elements have arrived, so a layer whose
tensors span two buckets must not be finalised in between, which calling ``reload_weights`` per bucket would do.
"""

from __future__ import annotations

import torch

from mcore_rl.rollout.repairs import check_reloadable, is_derived, repair_after_reload
from mcore_rl.rollout.transport import BucketHandle, open_bucket


class WeightUpdateExtension:
    """vLLM worker extension: streamed in-place weight updates, and KV-cache release where sleep mode is absent."""

    def mcore_rl_check_reloadable(self) -> None:
        check_reloadable(self.model_runner.get_model())

    def mcore_rl_begin_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.model_runner.get_model()
        self._mcore_rl_expected = {name for name, _ in model.named_parameters() if not is_derived(name)}
        self._mcore_rl_loaded: set[str] = set()
        initialize_layerwise_reload(model)

    def mcore_rl_load_bucket(self, handle: BucketHandle) -> int:
        """Load one bucket of HF-named full tensors into this worker's shard, cast to the engine's dtype."""
        dtype = self.model_runner.model_config.dtype
        device = self.model_runner.device
        buffer, tensors = open_bucket(handle, device, self.rank)
        model = self.model_runner.get_model()
        self._mcore_rl_loaded |= model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in tensors)
        _detach_pending(buffer)
        return handle.nbytes

    def mcore_rl_finish_update(self) -> list[str]:
        """Process layers still pending, drop state derived from old weights, apply build-specific repairs.

        Raises if some parameter received nothing: it would silently keep its old value.
        """
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner
        model = runner.get_model()
        finalize_layerwise_reload(model, runner.model_config)
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        repairs = repair_after_reload(model)
        missing = self._mcore_rl_expected - self._mcore_rl_loaded
        if getattr(model.config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")  # it is the embedding
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} parameter(s) stale: {sorted(missing)[:10]}")
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


def _detach_pending(buffer: torch.Tensor) -> None:
    """Copy out the tensors vLLM still holds for layers that are not complete yet: they view the sender's buffer,
    which the next bucket overwrites. Only a layer that straddles two buckets has any."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    ptr = buffer.untyped_storage().data_ptr()
    for info in LAYERWISE_INFO.values():
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == ptr:
                    bound.arguments[key] = value.clone()


def _flatten(caches) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        return [caches]
    return [t for c in caches for t in _flatten(c)]
