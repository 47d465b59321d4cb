"""megatron-core 0.16.1's quirks: CPU support (:mod:`compat.megatron_core.cpu`), the MoE router without
TransformerEngine (:func:`router_without_te`), torch Adam's checkpoints (:func:`install_adam_fixes`), multi-latent
attention without TransformerEngine (:func:`mla_without_te`), models and process groups that outlive a layout
(:func:`release_dispatcher_graphs`, :func:`destroy_groups`), Gated DeltaNet without flash-linear-attention
(:func:`gated_delta_net_without_fla`), an import that pulls in torch's compiler for
nothing (:func:`compile_on_first_call`), a process server behind every checkpoint save
(:func:`in_process_save_results`), the per-rank optimizer checkpoint's load into fp32 models
(:func:`dp_reshardable_load`), and weight gradients that autograd materialised before DDP added them
(:func:`accumulate_in_main_grads`).

**On CPU**: :mod:`compat.megatron_core.cpu`.

**On every device** (:func:`install_fixes` installs these wherever Megatron-Core runs, the CPU support on CPU
only, and returns their names: ``tests/unit/test_device.py`` lists what each device gets, so a fix that is not
about the CPU cannot end up in the CPU support by accident):

* The MoE router's gating GEMM (moe_utils.py:1192) reads ``te_general_gemm``, which is unbound when
  TransformerEngine does not import: every MoE model raised ``NameError`` on its first forward. It is bound to
  None, the value Megatron tests for, so the router takes its torch path.
* torch Adam's checkpoints. Megatron-Core falls back to ``torch.optim.AdamW`` where neither TransformerEngine nor
  Apex imports: always on CPU, and on GPUs without them. Its distributed optimizer then fails to load its own
  checkpoint with ``KeyError: 'step'`` (distrib_optimizer.py:940), or, from a per-rank (``dp_reshardable``)
  checkpoint, sets every parameter's step back to the one it held before the load (the loaded tensors get the
  already-restored step instead); and its load shares one ``step`` tensor among all parameters (:825), which Adam
  then advances once per parameter per step (the loaded states get their own copies). :func:`install_adam_fixes`
  installs both wherever that fallback is in use.
* torch Adam's speed. That fallback is built with neither ``fused`` nor ``foreach``, and on CPU torch then takes its
  per-tensor loop: 0.345 s a step for one rank's half of SmolLM2-135M's shard against 0.095 s fused (one thread).
  :func:`fuse_torch_adam` switches its parameter groups to torch's fused kernel (CPU and CUDA) once it is built; a
  checkpoint load keeps the flags (a checkpoint of the per-tensor loop resumes fused:
  ``tests/distributed/test_critic.py``).
* The per-rank optimizer checkpoint's load into fp32 models. Where the model's parameters are fp32, the distributed
  optimizer's main parameters are views of them (leaves that require grad); ``dp_reshardable``'s load
  (distrib_optimizer.py:1804, through :940) copies into them outside ``no_grad`` and raises "a view of a leaf
  Variable that requires grad is being used in an in-place operation" (bf16 models have main parameters of their
  own). :func:`dp_reshardable_load` runs that load under ``torch.no_grad()``, as the ``fully_reshardable`` load is.
* Weight gradients written into the gradient buffer. Megatron's DDP keeps each parameter's gradient in a flat buffer
  (``main_grad``); by default autograd first hands it a fresh full-size gradient, which DDP's hook adds in. Megatron's
  ``gradient_accumulation_fusion`` lets its linears accumulate into ``main_grad`` inside the GEMM, but only through
  Apex's CUDA extension (layers.py:44); and its vocabulary embedding's gradient is always a dense
  [vocabulary, hidden] tensor (``F.embedding``'s backward, layers.py:287: 113 MB per micro-batch for SmolLM2, and
  a tied LM head's gradient added to it). :func:`accumulate_in_main_grads` gives the linears Apex's contract in
  torch ops (one ``addmm_`` into the buffer) where Apex is absent, and lets an embedding add its rows there
  (``index_add_``) and hand autograd nothing; :func:`accumulate_weight_grads` switches a DDP-wrapped model's
  embeddings to it and drops the zeroed dummy that a tied weight's fused linears would otherwise add. One SmolLM2
  training phase of the main job (2 steps at DP 2, one core each): 3.72 -> 3.44 s.
* Gradient clipping's fallbacks. Without TransformerEngine or Apex (always on CPU), clip_grads.py:36-43 takes
  ``local_multi_tensor_l2_norm`` (a norm per tensor, collected through a host list) and
  ``local_multi_tensor_scale`` (a scaled copy per tensor, then a copy back): 140 ms of a 2.3 s SmolLM2 step at DP 2
  on CPU. :func:`foreach_clipping` puts torch's foreach kernels in their place (the same sums and products).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import types

import torch

from compat import MEGATRON_CORE, UpstreamChangedError, expect_parameters


def _keep_adam_step(original):
    """distrib_optimizer.py:940 copies every key of torch Adam's state, ``step`` included, from the loaded tensors.
    The step travels in the param groups and is already restored there (:817); the loaded tensors carry none
    (``fully_reshardable``: KeyError) or the step the state held before the load (``dp_reshardable`` keeps it as a
    local non-persistent object, :1663: every resumed parameter's Adam went back to the dummy state's step).
    Each parameter keeps its restored step."""

    @functools.wraps(original)
    def wrapped(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    return wrapped


def _unshare_adam_steps(original):
    """distrib_optimizer.py:825 gives every parameter's Adam state the *same* ``step`` tensor; torch's Adam
    increments each in place, so after a resume the step (and the bias correction) advanced once per parameter."""

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return result

    return wrapped


def set_attr_path(module, path: str, wrap) -> None:
    owner = module
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    raw = vars(owner)[name]
    if isinstance(raw, staticmethod | classmethod):
        setattr(owner, name, type(raw)(wrap(raw.__func__)))
    else:
        setattr(owner, name, wrap(raw))


INSTALLED_MARK = "_mcore_rl_installed"


# The distributed optimizer's methods the torch-Adam fixes wrap: their 0.16.1 parameters, and the wrapper.
_ADAM_WRAPPED = {
    "DistributedOptimizer._set_main_param_and_optimizer_states": (("self", "model_param", "tensors"), _keep_adam_step),
    "DistributedOptimizer.load_state_dict": (("self", "state_dict"), _unshare_adam_steps),
}


def target(module_name: str, path: str):
    owner = importlib.import_module(module_name)
    for part in path.split("."):
        if not hasattr(owner, part):
            raise UpstreamChangedError(
                f"{module_name}.{path}: not found in megatron-core (the CPU support targets 0.16.1)"
            )
        owner = getattr(owner, part)
    return owner


def check_version(what: str) -> None:
    import megatron.core

    if megatron.core.__version__ != MEGATRON_CORE:
        raise UpstreamChangedError(
            f"compat.megatron_core's {what} targets megatron-core=={MEGATRON_CORE}, found "
            f"{megatron.core.__version__}; re-read its call sites before changing the pin"
        )


def install_adam_fixes() -> bool:
    """Fix torch Adam's distributed-optimizer checkpoints (module docstring) where Megatron-Core uses torch's
    AdamW; returns whether they are installed. Idempotent; checks its targets first."""
    optimizer = importlib.import_module("megatron.core.optimizer")
    if optimizer.Adam is not torch.optim.AdamW:  # TransformerEngine's or Apex's FusedAdam: nothing to fix
        return False
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if getattr(distrib.DistributedOptimizer, INSTALLED_MARK, False):
        return True
    check_version("torch-Adam fix")
    for path, (params, _) in _ADAM_WRAPPED.items():  # every target checked before any is patched
        expect_parameters(target(distrib.__name__, path), params, f"{distrib.__name__}.{path}")
    for path, (_, wrap) in _ADAM_WRAPPED.items():
        set_attr_path(distrib, path, wrap)
    setattr(distrib.DistributedOptimizer, INSTALLED_MARK, True)
    return True


def fuse_torch_adam(optimizer) -> int:
    """Run the torch Adam(W) inside Megatron-Core's ``optimizer`` (a chained one, or one) through torch's fused
    kernel (module docstring); returns the number of parameter groups it runs. TransformerEngine's and Apex's
    FusedAdam are left as they are; so is a group whose parameters the fused kernel does not take. Idempotent."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = _get_fused_kernels_supported_devices()
    switched = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        check_version("fused torch Adam")
        for group in inner.param_groups:
            params = group["params"]
            if group["differentiable"] or not all(p.is_floating_point() and p.device.type in supported for p in params):
                continue
            group["fused"], group["foreach"] = True, False
            for p in params:  # the kernel takes each step count beside its parameter, as torch's own load puts it
                step = inner.state.get(p, {}).get("step")
                if torch.is_tensor(step) and step.device != p.device:
                    inner.state[p]["step"] = step.to(p.device, torch.float32)
            switched += 1
    return switched


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``local_multi_tensor_l2_norm``'s result (the norm of the tensors' norms, [1] fp32; no per-tensor norms):
    one foreach kernel, on the tensors' device."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``local_multi_tensor_scale``: ``dst = src * scale`` per pair, in place where they are the same tensors."""
    sources, targets = tensor_lists
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


# Module-level names bound to Megatron's local fallbacks, and what replaces each.
_CLIPPING_FALLBACKS = {
    ("megatron.core.optimizer.clip_grads", "l2_norm_impl"): ("local_multi_tensor_l2_norm", _foreach_l2_norm),
    ("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl"): ("local_multi_tensor_scale", _foreach_scale),
    ("megatron.core.optimizer.optimizer", "multi_tensor_scale_impl"): ("local_multi_tensor_scale", _foreach_scale),
}


def foreach_clipping() -> bool:
    """Replace gradient clipping's per-tensor fallbacks (module docstring) where they are in use; returns whether
    any is. Idempotent."""
    utils = importlib.import_module("megatron.core.utils")
    replaced = False
    for (module_name, name), (fallback, replacement) in _CLIPPING_FALLBACKS.items():
        module = importlib.import_module(module_name)
        current = getattr(module, name, None)
        if current is getattr(utils, fallback) or current is replacement:  # TE's or Apex's kernels stay
            check_version("foreach clipping")
            setattr(module, name, replacement)
            replaced = True
    return replaced


def dp_reshardable_load() -> bool:
    """Run the distributed optimizer's per-rank (``dp_reshardable``) checkpoint load without autograd (module
    docstring); True once installed. Idempotent; checks its target first."""
    path = "DistributedOptimizer.load_parameter_state_from_dp_reshardable"
    module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    method = target(module.__name__, path)
    if getattr(method, INSTALLED_MARK, False):
        return True
    check_version("per-rank optimizer checkpoint load")
    expect_parameters(method, ("self", "state_dict"), f"megatron.core.optimizer.distrib_optimizer.{path}")

    def wrap(original):
        @functools.wraps(original)
        @torch.no_grad()
        def wrapped(self, state_dict):
            return original(self, state_dict)

        setattr(wrapped, INSTALLED_MARK, True)
        return wrapped

    set_attr_path(module, path, wrap)
    return True


def router_without_te() -> bool:
    """Bind the router's ``te_general_gemm`` to None where TransformerEngine does not import (module docstring);
    returns whether it was needed. Idempotent."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if moe_utils.HAVE_TE:
        return False
    if not hasattr(moe_utils, "te_general_gemm"):
        check_version("router without TransformerEngine")
        moe_utils.te_general_gemm = None
    return True


def in_process_save_results() -> bool:
    """Give Megatron's checkpoint writer an in-process results queue (module docstring) before its first save; True
    once installed. Only for synchronous saves: an asynchronous one would never see its writer's results."""
    import queue

    module = "megatron.core.dist_checkpointing.strategies.filesystem_async"
    current = target(module, "_results_queue")
    target(module, "_get_write_results_queue")
    if isinstance(current, queue.Queue):
        return True
    if current is not None:
        raise UpstreamChangedError(f"{module}._results_queue: made before the fix ({type(current).__name__})")
    check_version("in-process save results")
    importlib.import_module(module)._results_queue = queue.Queue()
    return True


# ---- weight gradients into the gradient buffer -----------------------------------------------------------------------
def _accumulate_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T total_input`` (Apex's ``wgrad_gemm_accum_fp32/fp16``, called at layers.py:569 with
    both inputs flattened to 2-D): one GEMM into the buffer where the dtypes agree; bf16 activations into an fp32
    buffer are multiplied in their dtype and added, as Megatron's unfused path does (Apex accumulates in fp32)."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        main_grad.add_(grad_output.t().mm(total_input))


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """``F.embedding`` whose backward adds each position's gradient to its row of ``weight.main_grad`` and gives
    autograd no weight gradient: DDP's hook then has nothing to add for this use (it is not called for an untied
    embedding: the DDP of :class:`~mcore_rl.trainer.training.MegatronTrainStep` reduces at the step's end, not per
    parameter as ``overlap_grad_reduce`` would)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        main_grad.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype))
        return None, None


_ACCUMULATES = "_mcore_rl_accumulates"  # marks an embedding weight whose gradient goes into its main_grad


class _FunctionalWithAccumulatedEmbedding(types.ModuleType):
    """``torch.nn.functional`` as layers.py sees it (its only use is ``F.embedding``): the embedding of a weight that
    :func:`accumulate_weight_grads` marked goes through :class:`_EmbeddingIntoMainGrad` while gradients are
    recorded, everything else is torch's."""

    def __init__(self):
        super().__init__("torch.nn.functional")

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def embedding(ids, weight, *args, **kwargs):
        if args or kwargs or not (getattr(weight, _ACCUMULATES, False) and torch.is_grad_enabled()):
            return torch.nn.functional.embedding(ids, weight, *args, **kwargs)
        return _EmbeddingIntoMainGrad.apply(ids, weight)


_LAYERS = "megatron.core.tensor_parallel.layers"


def accumulate_in_main_grads() -> bool:
    """What lets a model's weight gradients go into ``main_grad`` (module docstring): linears get Apex's kernels'
    contract in torch ops where Apex does not import, embeddings a functional that :func:`accumulate_weight_grads`
    switches per weight. True once installed. Idempotent; checks its targets first."""
    layers = importlib.import_module(_LAYERS)
    if isinstance(layers.F, _FunctionalWithAccumulatedEmbedding):
        return True
    target(_LAYERS, "_grad_accum_fusion_available")
    if layers.F is not torch.nn.functional:
        raise UpstreamChangedError(f"{_LAYERS}.F: not torch.nn.functional (the embedding fix targets 0.16.1)")
    expect_parameters(layers.VocabParallelEmbedding.forward, ("self", "input_"), f"{_LAYERS}.VocabParallelEmbedding")
    check_version("weight gradients into main_grad")
    if not layers._grad_accum_fusion_available:  # no Apex: its kernels' contract in torch ops
        layers.fused_weight_gradient_mlp_cuda = types.SimpleNamespace(
            wgrad_gemm_accum_fp32=_accumulate_wgrad, wgrad_gemm_accum_fp16=_accumulate_wgrad
        )
        layers._grad_accum_fusion_available = True
    layers.F = _FunctionalWithAccumulatedEmbedding()
    return True


def accumulate_weight_grads(chunks: list[torch.nn.Module]) -> int:
    """Every weight gradient of the DDP-wrapped ``chunks`` (built with ``gradient_accumulation_fusion``) goes into
    its ``main_grad``: their vocabulary embeddings' too, and the zeroed dummies of tied weights are dropped.
    Returns the number of embeddings switched.

    Megatron marks a weight that two layers of one stage use (the tied embedding and LM head at PP 1, MTP's)
    ``zero_out_wgrad``, so that its fused linears hand autograd a *zeroed* full-size dummy (layers.py:583) which
    DDP's hook adds to ``main_grad`` (distributed_data_parallel.py:437): the embedding's real dense gradient must
    not meet an uninitialised one. With the embedding accumulating itself no real gradient of the weight reaches
    autograd, and the mark would cost a full-vocabulary fill and add per micro-batch: it is cleared."""
    layers = importlib.import_module(_LAYERS)
    if not isinstance(layers.F, _FunctionalWithAccumulatedEmbedding):
        raise RuntimeError("accumulate_weight_grads needs compat.megatron_core.accumulate_in_main_grads installed")
    switched = 0
    for chunk in chunks:
        if not chunk.config.gradient_accumulation_fusion:
            raise ValueError("accumulate_weight_grads: the model was built without gradient_accumulation_fusion")
        for module in chunk.modules():
            if isinstance(module, layers.VocabParallelEmbedding) and hasattr(module.weight, "main_grad"):
                setattr(module.weight, _ACCUMULATES, True)
                switched += 1
        for param in chunk.parameters():
            if getattr(param, "zero_out_wgrad", False):
                param.zero_out_wgrad = False
    return switched


def _cpu_support() -> bool:
    from compat.megatron_core.cpu import install_cpu_compat  # it builds on this module's helpers

    return install_cpu_compat()


def install_fixes(cpu: bool) -> list[str]:
    """Every megatron-core patch a process needs: the fixes for every device (those its Megatron-Core needs), and
    the CPU support where ``cpu``. Returns the names of those installed. Idempotent."""
    fixes = {
        "router_without_te": router_without_te,
        "torch_adam_checkpoints": install_adam_fixes,
        "in_process_save_results": in_process_save_results,
        "foreach_clipping": foreach_clipping,
        "dp_reshardable_load": dp_reshardable_load,
        "accumulate_in_main_grads": accumulate_in_main_grads,
        "cpu_support": _cpu_support if cpu else lambda: False,
    }
    return [name for name, install in fixes.items() if install()]


# ---- import time ---------------------------------------------------------------------------------------------------
def compile_on_first_call(jit: types.ModuleType) -> None:
    """``megatron/core/jit.py`` sets ``jit_fuser = torch.compile``, and ~40 fused functions are decorated with it
    at import: building each decorator imports torch's whole compiler stack (dynamo, inductor: 2 of Megatron-Core's
    6 s of import), even in processes that never call one of them (rollout engines, converters, the planner, dense
    models on CPU). Each decorated function is compiled by ``torch.compile`` on its first call on CUDA tensors
    (:func:`compiles`); on CPU tensors it runs as written: Inductor's CPU code for these elementwise fusions costs
    seconds of C++ compilation in every process that calls one (a tiny gpt-oss's first forward 4.8 s, the next
    0.5 s; MoE routers call ``_apply_expert_bias`` on every forward) and speeds nothing up measurably. Runs after
    ``jit.py`` executes (:data:`compat.AFTER_IMPORT`), before any module imports ``jit_fuser`` from it."""
    if jit.jit_fuser is not torch.compile:  # 0.16.1 on torch >= 2.2; anything else is left as Megatron chose
        return

    def jit_fuser(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if not compiles(args, kwargs):
                return fn(*args, **kwargs)
            if compiled is None:
                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)

        return call

    jit.jit_fuser = jit_fuser


def compiles(args: tuple, kwargs: dict) -> bool:
    """Whether a Megatron fused function called with these arguments is compiled: where a tensor is on CUDA."""
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))


# ---- Gated DeltaNet without flash-linear-attention ----------------------------------------------------------------
def gated_delta_net_without_fla() -> None:
    """0.16.1's ``GatedDeltaNet`` refuses to be built where flash-linear-attention does not import
    (gated_delta_net.py:103), though only its forward uses fla's kernels; :class:`models.gated_delta.GatedDeltaNet`
    has a forward of its own that takes :mod:`compat.fla`'s there. Idempotent."""
    if importlib.util.find_spec("fla") is not None:
        return
    module = "megatron.core.ssm.gated_delta_net"
    target(module, "HAVE_FLA")
    importlib.import_module(module).HAVE_FLA = True


def gated_delta_net_tensor_parallel(module: torch.nn.Module) -> None:
    """0.16.1's ``GatedDeltaNet`` creates ``conv1d``, ``dt_bias`` and ``A_log`` on ``torch.cuda.current_device()``
    explicitly (gated_delta_net.py:184-231), outside the device a meta build of the model runs under (the other
    layers create theirs there), and marks them tensor-parallel without a ``partition_dim`` (its state dict splits
    them by hand). Moved to that device, they would lose the mark; here they are created there, all marked split
    along dim 0 (by channel or head), as the rest of Megatron's parameters say it."""
    build = torch.empty(0).device  # the device a ``with torch.device(...)`` build puts tensors on
    for owner, name in ((module.conv1d, "weight"), (module.conv1d, "bias"), (module, "dt_bias"), (module, "A_log")):
        param = getattr(owner, name)
        if param is None:
            continue
        if build.type == "meta" and param.device != build:
            param = torch.nn.Parameter(torch.empty_like(param, device=build), requires_grad=param.requires_grad)
            setattr(owner, name, param)
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1


# ---- attention sinks ------------------------------------------------------------------------------------------------
def sinks_split_by_head(chunks: list[torch.nn.Module]) -> int:
    """Mark attention sinks (``softmax_offset``: one per attention head of this TP rank) split over TP along dim 0.

    0.16.1's ``DotProductAttention`` and TransformerEngine's attention create them as plain parameters; only their
    ``sharded_state_dict`` says they are split (dot_product_attention.py:267, transformer_engine.py:1450), so the
    export and the checkpoint check would take each rank's share for the whole. Returns how many it marked."""
    marked = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name.rsplit(".", 1)[-1] == "softmax_offset" and not getattr(param, "tensor_model_parallel", False):
                param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
                marked += 1
    return marked


# ---- expert biases ------------------------------------------------------------------------------------------------
def _own_output(module, inputs, output):
    out, bias = output
    return (out.clone() if out._is_view() else out), bias


def expert_biases(chunks: list[torch.nn.Module]) -> int:
    """Two faults of experts with biases (gpt-oss's) in 0.16.1, fixed on the built model; returns the experts fixed.

    * ``MLP.forward`` adds an expert's probability-weighted output bias in place (mlp.py:247) to what its
      ``linear_fc2`` returns: for experts without tensor parallelism (the only kind biases allow), the reduction's
      input returned as is, a view autograd refuses to let change at the first backward ("Output 0 of
      _ReduceFromModelParallelRegion is a view and is being modified inplace"). ``linear_fc2`` returns its own copy.
    * ``RowParallelLinear`` marks its bias ``sequence_parallel`` (layers.py:1228), so ``finalize_model_grads`` sums
      its gradient over the TP group; an expert's gradients are already reduced over its expert-data-parallel group,
      which holds those TP ranks when experts have no TP: TP times the gradient. The mark is cleared."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    fixed = 0
    for module in (m for chunk in chunks for m in chunk.modules() if isinstance(m, SequentialMLP)):
        for expert in module.local_experts:
            bias = getattr(expert.linear_fc2, "bias", None)
            if isinstance(bias, torch.Tensor) and bias.numel():
                expert.linear_fc2.register_forward_hook(_own_output)
                bias.sequence_parallel = False
                fixed += 1
    return fixed


def expert_norms_by_expert_tp(optimizer, expt_tp_group) -> int:
    """Give the experts' optimizer of Megatron-Core's ``optimizer`` the expert-TP group to tell TP duplicates by in
    the gradient norm; returns how many optimizers it changed.

    0.16.1 gives every optimizer of a chain the dense TP group (optimizer/__init__.py:473), and a parameter not split
    over TP counts in the norm on TP rank 0 only (layers.py:89). Expert parameters not split over TP (row-parallel
    expert biases, gpt-oss's) are no TP duplicates: the distributed optimizer shards them over the expert-data-parallel
    group, which holds every dense TP rank when experts have no TP. The norm left out all but rank 0's shards."""
    changed = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)  # None: an optimizer of no parameters (a frozen LoRA model's)
        if inner is not None and any(group.get("is_expert_parallel") for group in inner.param_groups):
            check_version("expert TP group of the gradient norm")
            chained.tp_group = expt_tp_group
            changed += 1
    return changed


# ---- MLA without TransformerEngine --------------------------------------------------------------------------------
def mla_without_te() -> None:
    """0.16.1 builds its TE wrappers on a MagicMock when TE is absent, so multi-latent attention believes TE is there
    and fails on ``isinstance(..., TELinear)`` (multi_latent_attention.py:185; fixed upstream in 0.19). Tell it TE
    is absent, where it is. Idempotent."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    module = "megatron.core.transformer.multi_latent_attention"
    target(module, "HAVE_TE")
    importlib.import_module(module).HAVE_TE = False


# ---- layout changes -----------------------------------------------------------------------------------------------
# Module methods wrapped in ``functools.lru_cache`` (0.16.1): the cache keys hold the modules, and so every model's
# rotary embedding (with its context-parallel group) stays alive after the model is gone.
_CACHED_METHODS = (
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.forward"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding.forward"),
)
# Module-level dicts that keep a layout's groups (0.16.1): the MoE aux-loss logging tracker stores each loss's
# reduce and average groups (moe_utils.py:898), and its per-layer values are sized for the model that filled it.
_LAYOUT_DICTS = (("megatron.core.transformer.moe.moe_utils", "_MOE_LAYER_WISE_LOGGING_TRACKER"),)


def release_dispatcher_graphs(chunks: list[torch.nn.Module]) -> None:
    """Drop the autograd graphs Megatron's MoE token dispatchers keep from the last forward.

    0.16.1's dispatchers store the batch's routing probabilities as attributes (token_dispatcher.py:610 ``probs``,
    :291 ``local_probs``). Through their graph the router weight's gradient accumulator, DDP's hook on it, and
    so the model refer back to the dispatcher: a cycle through C++ autograd nodes, which Python's collector cannot
    see, so a model that took a training step was never freed (nor its process groups and their gloo threads).
    Every tensor attribute with a graph is dropped; the next forward sets them again."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                state = vars(module.token_dispatcher)
                for name, value in state.items():
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        state[name] = None


def _held_groups(module) -> dict[str, list[torch.distributed.ProcessGroup]]:
    """The process groups (other than the default one) each of ``module``'s globals holds, alone or in a list."""
    held = {}
    for name, value in vars(module).items():
        groups = [
            g
            for g in (value if isinstance(value, list | tuple) else [value])
            if isinstance(g, torch.distributed.ProcessGroup) and g is not torch.distributed.GroupMember.WORLD
        ]
        if groups:
            held[name] = groups
    return held


def destroy_groups() -> bool:
    """Tear down Megatron's parallel state *and its process groups*; whether there were any.

    0.16.1's ``destroy_model_parallel`` only drops its references, and not all of them (it leaves
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` set): the groups stay alive, and on gloo each keeps its connection
    threads. Here every group the module holds is destroyed and its reference dropped, and the caches and MoE
    tracker that keep old models (and their groups) alive are cleared; the threads stop once nothing refers to the groups (see
    :func:`compat.torch.release_groups`).
    """
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return False
    held = _held_groups(parallel_state)
    parallel_state.destroy_model_parallel()
    for name in _held_groups(parallel_state).keys() & held.keys():  # what destroy_model_parallel forgot
        setattr(parallel_state, name, None)
    for group in {id(g): g for groups in held.values() for g in groups}.values():
        torch.distributed.destroy_process_group(group)
    for module_name, path in _CACHED_METHODS:
        method = target(module_name, path)
        if not hasattr(method, "cache_clear"):
            raise UpstreamChangedError(f"{module_name}.{path}: no longer an lru_cache; drop it from _CACHED_METHODS")
        method.cache_clear()
    for module_name, name in _LAYOUT_DICTS:
        state = target(module_name, name)
        if not isinstance(state, dict):
            raise UpstreamChangedError(f"{module_name}.{name}: no longer a dict; drop it from _LAYOUT_DICTS")
        state.clear()
    return True
