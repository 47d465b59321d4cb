"""megatron-core 0.16.1's quirks: CPU support (:func:`install_cpu_compat`), the MoE router without
TransformerEngine (:func:`router_without_te`), torch Adam's checkpoints (:func:`install_adam_fixes`), multi-latent
attention without TransformerEngine (:func:`mla_without_te`), models and process groups that outlive a layout
(:func:`release_dispatcher_graphs`, :func:`destroy_groups`), and an import that pulls in torch's compiler for
nothing (:func:`compile_on_first_call`).

**On CPU** (gloo), for CI and laptops; installed by :func:`install_fixes` on CPU machines only. Megatron-Core
calls CUDA unconditionally in places that have no extension point. Rather than a global ``TorchFunctionMode``
(measured +30% per step on tiny models, and it disables dynamo), this module rebinds the name ``torch`` *inside
the listed Megatron modules only* to a proxy that forwards everything to torch except:

* ``torch.cuda``: RNG calls go to the CPU generator (the model-parallel RNG tracker then forks CPU states, so
  TP-region initialisation and dropout keep Megatron's semantics); ``current_device()`` is ``cpu``;
  streams, events, ``synchronize``, ``empty_cache`` and NVTX are no-ops.
* tensor factories (``zeros``, ``empty``, ``tensor``, ...), ``torch.device`` and ``torch.autocast``: a CUDA
  device argument becomes ``cpu``.

Covered modules and their call sites (megatron/core/..., 0.16.1 line numbers):

==========================================  ==========================================================
tensor_parallel/random.py                   RNG tracker: cuda get/set_rng_state, manual_seed, _lazy_call
                                            (:55, :103, :235-238, :422; _lazy_call silently drops the
                                            callback on CPU builds, so it is rebound to call at once)
tensor_parallel/mappings.py                 current_device() buffers for TP/SP gathers (:91-181, :442)
tensor_parallel/layers.py                   current_device() for weights and SP all-gather (:261-1218)
models/common/embeddings/rotary_pos_embedding.py   inv_freq / positions on current_device (:78, :162, :297)
models/common/embeddings/yarn_rotary_pos_embedding.py   same, YaRN variant
models/common/embeddings/rope_utils.py      pinned CP index tensor for the RoPE slice (:63)
transformer/utils.py                        device="cuda" causal masks (:35, :40)
utils.py                                    GlobalMemoryBuffer (:631), local l2-norm fallback (:1207)
pipeline_parallel/schedules.py              device="cuda" token counters (:596, :983, :2138)
pipeline_parallel/p2p_communication.py      current_device() recv buffers, synchronize (:190-398)
transformer/moe/router.py                   current_device() router weights and aux-loss scalars (:90-198)
transformer/moe/token_dispatcher.py         cuda.Stream/Event for the alltoall D2H copy (:445, :871-895)
transformer/moe/moe_utils.py                device="cuda" aux-loss tracker (:998)
optimizer/optimizer.py                      device='cuda' found_inf/scale tensors (:473-485, :907, :1141)
optimizer/clip_grads.py                     device='cuda' norm buffers (:90-207)
optimizer/distrib_optimizer.py              current_device() buffers (:791, :1077)
distributed/param_and_grad_buffer.py        cuda streams, current_device() buffers (:417-806)
dist_checkpointing/strategies/              synchronize before the writers start (filesystem_async.py:230,
                                            state_dict_saver.py:252)
transformer/multi_token_prediction.py       current_device() receive buffers of the context-parallel roll
                                            of the MTP layers' inputs and labels (:178)
==========================================  ==========================================================

What a module-level proxy cannot reach is patched narrowly:

* ``tensor.type() == 'torch.cuda.FloatTensor'`` checks (clip_grads.py:167, distrib_optimizer.py:361/420/582)
  and ``tensor.cuda()`` (optimizer.py:375/380; language_module.py:244, the tied output layer's copy on the last
  pipeline stage; distrib_optimizer.py:1089, gathering optimizer state for a checkpoint; rope_utils.py:64, the
  context-parallel RoPE slice): the owning functions run under a scoped mode that reports CPU
  tensors with their CUDA type names and makes ``.cuda()`` the identity.
* token_dispatcher.py:876-892 converts the alltoall split sizes to numpy only for CUDA tensors; CPU tensors
  reach ``all_to_all_single``, which rejects them. The CPU version converts them too.
* mappings.py:150/190 gather and reduce-scatter *uneven* token counts (the alltoall dispatcher with expert-TP
  > 1) as lists of different sizes, which NCCL accepts and gloo rejects. The CPU versions pad to the longest
  split (gather) or all-reduce and slice (reduce-scatter); even splits still take Megatron's path.

**On every device** (:func:`install_fixes` installs these wherever Megatron-Core runs, the CPU support on CPU
only, and returns their names: ``tests/unit/test_device.py`` lists what each device gets, so a fix that is not
about the CPU cannot end up in the CPU support by accident):

* The MoE router's gating GEMM (moe_utils.py:1192) reads ``te_general_gemm``, which is unbound when
  TransformerEngine does not import: every MoE model raised ``NameError`` on its first forward. It is bound to
  None, the value Megatron tests for, so the router takes its torch path.
* torch Adam's checkpoints. Megatron-Core falls back to ``torch.optim.AdamW`` where neither TransformerEngine nor
  Apex imports: always on CPU, and on GPUs without them. Its distributed optimizer then fails to load its own
  checkpoint with ``KeyError: 'step'`` (distrib_optimizer.py:940; the loaded tensors get the already-restored step
  added), and its load shares one ``step`` tensor among all parameters (:825), which Adam then advances once per
  parameter per step (the loaded states get their own copies). :func:`install_adam_fixes` installs both wherever
  that fallback is in use.

``torch_norm``'s sequence-parallel assert is not patched: our layer spec substitutes its own norm module
(:mod:`models.spec`), Megatron's intended extension point. ``tests/distributed/test_cpu_compat.py`` fails when a
training step reaches a CUDA call site that this module does not cover.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import types

import torch
from torch.overrides import TorchFunctionMode

from compat import MEGATRON_CORE, UpstreamChangedError, expect_parameters

PROXIED_MODULES = (
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.transformer.multi_token_prediction",
)

# (module, attribute path) of functions that check tensor.type() against CUDA names or call tensor.cuda().
_CUDA_TENSOR_CALLERS = (
    ("megatron.core.models.common.language_module.language_module", "LanguageModule.setup_embeddings_and_output_layer"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),  # imported by name there
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer.restore_from_cpu"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero"),
    # context parallelism's RoPE slice; imported by name by both rotary embeddings
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
)

_FACTORIES = (
    "arange",
    "empty",
    "empty_like",
    "full",
    "ones",
    "ones_like",
    "rand",
    "randn",
    "randint",
    "tensor",
    "zeros",
    "zeros_like",
)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)


def _cpu_device(*args, **kwargs) -> torch.device:
    if (args and _is_cuda(args[0])) or _is_cuda(kwargs.get("type", "cpu")):
        return torch.device("cpu")
    return torch.device(*args, **kwargs)


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)  # no pinned-memory allocator without CUDA
        return fn(*args, **kwargs)

    return wrapped


def _cpu_autocast(device_type, *args, **kwargs):
    return torch.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream``/``Event``: CPU work is already ordered, so every call is a no-op
    that returns another null stream/event (``record_event()`` results get ``synchronize()``-d later)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _NullStream()

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    __hash__ = object.__hash__


class _AnyIndex:
    """``torch.cuda.default_generators[i]`` -> the CPU generator, whatever ``i`` is."""

    def __getitem__(self, index):
        return torch.default_generator


def _noop(*args, **kwargs):
    return None


def _make_cuda_namespace() -> types.SimpleNamespace:
    random = types.SimpleNamespace(
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
    )
    return types.SimpleNamespace(
        is_available=lambda: False,
        current_device=lambda: torch.device("cpu"),
        device_count=lambda: 0,
        get_rng_state=random.get_rng_state,
        set_rng_state=random.set_rng_state,
        manual_seed=torch.manual_seed,
        random=random,
        default_generators=_AnyIndex(),
        synchronize=_noop,
        empty_cache=_noop,
        Stream=_NullStream,
        Event=_NullStream,
        current_stream=_NullStream,
        default_stream=_NullStream,
        stream=lambda stream=None: contextlib.nullcontext(),
        nvtx=types.SimpleNamespace(range_push=_noop, range_pop=_noop),
        amp=torch.amp,
        CUDAGraph=types.SimpleNamespace(),
    )


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by a covered Megatron module on a CPU-only process."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cuda_namespace()
        self.device = _cpu_device
        self.autocast = _cpu_autocast
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


class _CudaTypeNames(TorchFunctionMode):
    """Within Megatron functions that insist on CUDA tensors: CPU tensors answer with CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return "torch.cuda." + torch.Tensor.type(args[0]).rsplit(".", 1)[-1]
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _call_now(fn, **kwargs):
    """torch.cuda's ``_lazy_call`` queues ``fn`` until CUDA initialises, which on CPU never happens."""
    return fn()


def _under_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _CudaTypeNames():
            return fn(*args, **kwargs)

    return wrapped


def _move_splits_to_numpy(original):
    @functools.wraps(original)
    def wrapped(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return wrapped


def _gloo_uneven_gather(original):
    @functools.wraps(original)
    def wrapped(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros(max(output_split_sizes), *input_.shape[1:])
        padded[: input_.shape[0]] = input_
        gathered = [torch.empty_like(padded) for _ in range(group.size())]
        torch.distributed.all_gather(gathered, padded, group=group)
        return torch.cat([g[:n] for g, n in zip(gathered, output_split_sizes, strict=True)])

    return wrapped


def _gloo_uneven_reduce_scatter(original):
    @functools.wraps(original)
    def wrapped(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]].clone()

    return wrapped


def _keep_adam_step(original):
    """distrib_optimizer.py:940 copies every key of torch Adam's state, ``step`` included, from the loaded
    tensors, which carry no ``step`` (it travels in the param groups and is already restored): KeyError."""

    @functools.wraps(original)
    def wrapped(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
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


def _set_attr_path(module, path: str, wrap) -> None:
    owner = module
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    raw = vars(owner)[name]
    if isinstance(raw, staticmethod | classmethod):
        setattr(owner, name, type(raw)(wrap(raw.__func__)))
    else:
        setattr(owner, name, wrap(raw))


_INSTALLED_MARK = "_mcore_rl_installed"

# Functions the CPU support wraps, with the parameters they had in 0.16.1 (checked before wrapping).
_WRAPPED = {
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"): (
        "tensor",
        "as_numpy",
        "record_stream",
    ),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"): (
        "input_",
        "group",
        "output_split_sizes",
        "use_global_buffer",
    ),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim"): (
        "input_",
        "group",
        "input_split_sizes",
        "use_global_buffer",
    ),
    ("megatron.core.tensor_parallel.random", "_lazy_call"): ("callable", "kwargs"),  # torch.cuda's, by name
}

# The distributed optimizer's methods the torch-Adam fixes wrap: their 0.16.1 parameters, and the wrapper.
_ADAM_WRAPPED = {
    "DistributedOptimizer._set_main_param_and_optimizer_states": (("self", "model_param", "tensors"), _keep_adam_step),
    "DistributedOptimizer.load_state_dict": (("self", "state_dict"), _unshare_adam_steps),
}


def _target(module_name: str, path: str):
    owner = importlib.import_module(module_name)
    for part in path.split("."):
        if not hasattr(owner, part):
            raise UpstreamChangedError(
                f"{module_name}.{path}: not found in megatron-core (the CPU support targets 0.16.1)"
            )
        owner = getattr(owner, part)
    return owner


def _check_targets() -> None:
    """Every patched module, function and attribute is there, with the parameters it had in 0.16.1."""
    for name in PROXIED_MODULES:
        _target(name, "torch")
    for module_name, path in _CUDA_TENSOR_CALLERS:
        _target(module_name, path)
    for (module_name, path), params in _WRAPPED.items():
        expect_parameters(_target(module_name, path), params, f"{module_name}.{path}")


def _check_version(what: str) -> None:
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
    if getattr(distrib.DistributedOptimizer, _INSTALLED_MARK, False):
        return True
    _check_version("torch-Adam fix")
    for path, (params, _) in _ADAM_WRAPPED.items():  # every target checked before any is patched
        expect_parameters(_target(distrib.__name__, path), params, f"{distrib.__name__}.{path}")
    for path, (_, wrap) in _ADAM_WRAPPED.items():
        _set_attr_path(distrib, path, wrap)
    setattr(distrib.DistributedOptimizer, _INSTALLED_MARK, True)
    return True


def install_cpu_compat() -> bool:
    """Make Megatron-Core runnable on this process's CPU (never call it on a CUDA machine: it reroutes
    Megatron's CUDA calls); returns True. Idempotent. Refuses (``UpstreamChangedError``) a megatron-core whose
    patched functions are not the ones the call sites above were read from.
    """
    import megatron.core

    if getattr(megatron.core, _INSTALLED_MARK, False):
        return True
    _check_version("CPU support")
    _check_targets()

    cpu_torch = _CpuTorch()
    for name in PROXIED_MODULES:
        importlib.import_module(name).torch = cpu_torch

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._lazy_call = functools.wraps(random._lazy_call)(_call_now)  # _check_targets still sees its signature
    random._lazy_init = _noop

    for module_name, path in _CUDA_TENSOR_CALLERS:
        _set_attr_path(importlib.import_module(module_name), path, _under_cuda_type_names)

    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.maybe_move_tensor_to_cpu = _move_splits_to_numpy(dispatcher.maybe_move_tensor_to_cpu)

    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    mappings._gather_along_first_dim = _gloo_uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _gloo_uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)

    setattr(megatron.core, _INSTALLED_MARK, True)
    return True


def router_without_te() -> bool:
    """Bind the router's ``te_general_gemm`` to None where TransformerEngine does not import (module docstring);
    returns whether it was needed. Idempotent."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if moe_utils.HAVE_TE:
        return False
    if not hasattr(moe_utils, "te_general_gemm"):
        _check_version("router without TransformerEngine")
        moe_utils.te_general_gemm = None
    return True


def install_fixes(cpu: bool) -> list[str]:
    """Every megatron-core patch a process needs: the fixes for every device (those its Megatron-Core needs), and
    the CPU support where ``cpu``. Returns the names of those installed. Idempotent."""
    fixes = {
        "router_without_te": router_without_te,
        "torch_adam_checkpoints": install_adam_fixes,
        "cpu_support": install_cpu_compat if cpu else lambda: False,
    }
    return [name for name, install in fixes.items() if install()]


# ---- import time ---------------------------------------------------------------------------------------------------
def compile_on_first_call(jit: types.ModuleType) -> None:
    """``megatron/core/jit.py`` sets ``jit_fuser = torch.compile``, and ~40 fused functions are decorated with it
    at import: building each decorator imports torch's whole compiler stack (dynamo, inductor: 2 of Megatron-Core's
    6 s of import), even in processes that never call one of them (rollout engines, converters, the planner, dense
    models on CPU; MoE routers call ``_apply_expert_bias`` on every forward). Each decorated function is compiled
    by ``torch.compile`` as before, on its first call. Runs after ``jit.py`` executes
    (:data:`compat.AFTER_IMPORT`), before any module imports ``jit_fuser`` from it."""
    if jit.jit_fuser is not torch.compile:  # 0.16.1 on torch >= 2.2; anything else is left as Megatron chose
        return

    def jit_fuser(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)

        return call

    jit.jit_fuser = jit_fuser


# ---- MLA without TransformerEngine --------------------------------------------------------------------------------
def mla_without_te() -> None:
    """0.16.1 builds its TE wrappers on a MagicMock when TE is absent, so multi-latent attention believes TE is there
    and fails on ``isinstance(..., TELinear)`` (multi_latent_attention.py:185; fixed upstream in 0.19). Tell it TE
    is absent, where it is. Idempotent."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    module = "megatron.core.transformer.multi_latent_attention"
    _target(module, "HAVE_TE")
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
        method = _target(module_name, path)
        if not hasattr(method, "cache_clear"):
            raise UpstreamChangedError(f"{module_name}.{path}: no longer an lru_cache; drop it from _CACHED_METHODS")
        method.cache_clear()
    for module_name, name in _LAYOUT_DICTS:
        state = _target(module_name, name)
        if not isinstance(state, dict):
            raise UpstreamChangedError(f"{module_name}.{name}: no longer a dict; drop it from _LAYOUT_DICTS")
        state.clear()
    return True
