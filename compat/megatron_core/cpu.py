"""megatron-core 0.16.1 **on CPU** (gloo), for CI and laptops; installed by
:func:`compat.megatron_core.install_fixes` on CPU machines only. Megatron-Core
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
ssm/gated_delta_net.py                      current_device() conv1d, dt_bias and A_log (:184-231)
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

* param_and_grad_buffer.py:35-36 (``dist_reduce_scatter_func``, ``dist_all_gather_func``): the data-parallel
  grad reduce-scatter and param all-gather of every bucket can be routed elsewhere (:func:`route_bucket_collectives`;
  :func:`parallel.groups.init_parallel` routes them through shared memory on CPU, where gloo's take about a third
  of a step on 2 cores).

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

from compat import UpstreamChangedError, expect_parameters
from compat.megatron_core import INSTALLED_MARK, check_version, set_attr_path, target

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
    "megatron.core.ssm.gated_delta_net",
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


def loaded_later(weight: torch.Tensor) -> None:
    """The init method of a weight that a load overwrites right after the build (``models.bridge.INIT_SKIPPED``):
    none; on CPU it also spares the master weight (:func:`_no_master_weight_when_loaded`)."""


def _no_master_weight_when_loaded(original):
    """Megatron's CPU init builds each weight's full fp32 master weight, draws it and copies this rank's shard into
    the weight; for a weight loaded next (``init_method`` :func:`loaded_later`) only the tensor-parallel attributes
    it sets stay (the loader reads them): no master weight, no copy."""

    @functools.wraps(original)
    def wrapped(weight, output_size, input_size, per_partition_size, partition_dim, init_method, stride=1,
                return_master_weight=False, **kwargs):  # fmt: skip
        if init_method is not loaded_later or return_master_weight:
            return original(weight, output_size, input_size, per_partition_size, partition_dim, init_method, stride,
                            return_master_weight, **kwargs)  # fmt: skip
        if not kwargs.get("skip_set_tensor_parallel_attributes", False):
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
        return None

    return wrapped


_MASTER_WEIGHT_CALLERS = ("megatron.core.tensor_parallel.layers", "megatron.core.transformer.moe.experts")
_MASTER_WEIGHT_PARAMETERS = (
    "weight",
    "output_size",
    "input_size",
    "per_partition_size",
    "partition_dim",
    "init_method",
    "stride",
    "return_master_weight",
    "params_dtype",
    "rank",
    "world_size",
    "skip_set_tensor_parallel_attributes",
)

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
    **{(name, "_initialize_affine_weight_cpu"): _MASTER_WEIGHT_PARAMETERS for name in _MASTER_WEIGHT_CALLERS},
}


# Megatron's bucket collectives (param_and_grad_buffer.py): the names it calls and torch's functions they hold.
_BUCKET_COLLECTIVES = {
    "dist_reduce_scatter_func": torch.distributed.reduce_scatter_tensor,
    "dist_all_gather_func": torch.distributed.all_gather_into_tensor,
}
_BUCKETS = "megatron.core.distributed.param_and_grad_buffer"


def check_targets() -> None:
    """Every patched module, function and attribute is there, with the parameters it had in 0.16.1."""
    for name in PROXIED_MODULES:
        target(name, "torch")
    for name in _BUCKET_COLLECTIVES:
        target(_BUCKETS, name)
    for module_name, path in _CUDA_TENSOR_CALLERS:
        target(module_name, path)
    for (module_name, path), params in _WRAPPED.items():
        expect_parameters(target(module_name, path), params, f"{module_name}.{path}")


def route_bucket_collectives(collectives) -> bool:
    """Megatron's bucket reduce-scatter and all-gather (``_BUCKET_COLLECTIVES``) become the ``reduce_scatter_tensor``
    and ``all_gather_into_tensor`` methods of ``collectives(reduce_scatter, all_gather)``, a class built on torch's
    two functions (what it falls back to). Once per process (returns False when already routed); refuses a
    megatron-core whose names hold other functions."""
    buckets = importlib.import_module(_BUCKETS)
    if getattr(buckets, INSTALLED_MARK, False):
        return False
    check_version("bucket collectives")
    for name, function in _BUCKET_COLLECTIVES.items():
        if target(_BUCKETS, name) is not function:
            raise UpstreamChangedError(f"{_BUCKETS}.{name} is not torch.distributed.{function.__name__}")
    routed = collectives(*_BUCKET_COLLECTIVES.values())
    buckets.dist_reduce_scatter_func = routed.reduce_scatter_tensor
    buckets.dist_all_gather_func = routed.all_gather_into_tensor
    setattr(buckets, INSTALLED_MARK, True)
    return True


def install_cpu_compat() -> bool:
    """Make Megatron-Core runnable on this process's CPU (never call it on a CUDA machine: it reroutes
    Megatron's CUDA calls); returns True. Idempotent. Refuses (``UpstreamChangedError``) a megatron-core whose
    patched functions are not the ones the call sites above were read from.
    """
    import megatron.core

    if getattr(megatron.core, INSTALLED_MARK, False):
        return True
    check_version("CPU support")
    check_targets()

    cpu_torch = _CpuTorch()
    for name in PROXIED_MODULES:
        importlib.import_module(name).torch = cpu_torch

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._lazy_call = functools.wraps(random._lazy_call)(_call_now)  # check_targets still sees its signature
    random._lazy_init = _noop

    for module_name, path in _CUDA_TENSOR_CALLERS:
        set_attr_path(importlib.import_module(module_name), path, _under_cuda_type_names)

    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.maybe_move_tensor_to_cpu = _move_splits_to_numpy(dispatcher.maybe_move_tensor_to_cpu)

    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    mappings._gather_along_first_dim = _gloo_uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _gloo_uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)

    no_master = _no_master_weight_when_loaded(
        importlib.import_module(_MASTER_WEIGHT_CALLERS[0])._initialize_affine_weight_cpu
    )
    for name in _MASTER_WEIGHT_CALLERS:  # each imported the function by name
        importlib.import_module(name)._initialize_affine_weight_cpu = no_master

    setattr(megatron.core, INSTALLED_MARK, True)
    return True
