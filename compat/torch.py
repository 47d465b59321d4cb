"""torch 2.13's quirks: CUDA IPC handles carry the sender's device ordinal, destroyed gloo groups keep their
threads while anything refers to them, the fake process group's store is private API, and concatenating meta
tensors or building an optimizer imports the compiler."""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Sequence

import torch
import torch._compile
from torch.optim.optimizer import _use_grad_for_differentiable

from compat import UpstreamChangedError, expect_parameters

# torch.multiprocessing.reductions.rebuild_cuda_tensor's parameters (2.13); ``storage_device`` is the ordinal the
# sending process gave the GPU.
_REBUILD_CUDA_TENSOR = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def rebuild_cuda_tensor(reduction: tuple, device_index: int):
    """The CUDA tensor of ``reduce_tensor``'s ``(rebuild, args)`` from another process, on the GPU this process
    numbers ``device_index``: the reduction records the sender's ordinal, which differs where the two processes see
    different ``CUDA_VISIBLE_DEVICES`` (a Ray actor beside a trainer rank)."""
    rebuild, args = reduction
    expect_parameters(rebuild, _REBUILD_CUDA_TENSOR, "torch.multiprocessing.reductions.rebuild_cuda_tensor")
    args = list(args)
    args[_REBUILD_CUDA_TENSOR.index("storage_device")] = device_index
    return rebuild(*args)


def release_groups() -> None:
    """Free destroyed process groups that old objects still refer to. ``destroy_process_group`` shuts a gloo group
    down but its runloop and TCP threads stop only when the group object is freed; Megatron models and optimizers of
    an old layout hold their groups in reference cycles, which only the cycle collector frees (measured: 1,600
    threads per rank after a test session's layout changes, against 12 after collecting)."""
    gc.collect()


def fake_store():
    """The store of torch's fake process group (``torch.testing._internal``: private, present in 2.13)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def cat(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat``, without the compiler for meta tensors. torch 2.13's meta ``cat`` is a Python kernel whose
    ``out_wrapper`` imports ``torch._dynamo`` on first use: 1.5 s of CPU in every process that checks a checkpoint's
    shapes on meta tensors (:func:`converters.mapping.check_tensors`: each role's load, each converter, each dry
    run). Meta tensors get the shape ``torch.cat`` would give, or its error; others go to ``torch.cat``."""
    if not parts[0].is_meta:
        return torch.cat(list(parts), dim)
    first = parts[0].shape
    dim = dim % len(first)
    for part in parts[1:]:
        if part.dim() != len(first) or any(
            a != b for i, (a, b) in enumerate(zip(part.shape, first, strict=True)) if i != dim
        ):
            raise RuntimeError(
                f"Sizes of tensors must match except in dimension {dim}: {list(first)}, {list(part.shape)}"
            )
    shape = [*first[:dim], sum(p.shape[dim] for p in parts), *first[dim + 1 :]]
    return parts[0].new_empty(shape)


# The bodies of the wrappers torch 2.13 puts on optimizer methods to keep them out of compiled graphs: around
# ``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` (``torch._disable_dynamo``, which caches
# dynamo's wrapper on the function under ``__dynamo_disable``) and around each optimizer's ``step``
# (``_use_grad_for_differentiable``).
_DISABLE_DYNAMO_CODE = torch._compile._disable_dynamo(lambda: None).__code__
_USE_GRAD_CODE = _use_grad_for_differentiable(lambda self: None).__code__


def optimizers_without_compiler() -> None:
    """torch's optimizers built and stepped without importing ``torch._dynamo`` while nothing compiles. torch 2.13
    imports it at the first call of each wrapper above (:data:`_DISABLE_DYNAMO_CODE`, :data:`_USE_GRAD_CODE`), to
    exclude the method from graphs being compiled: 0.8-1.7 s of CPU in every trainer rank, which compiles nothing.
    Each method now runs as the wrapper would in eager mode until dynamo has been imported (``torch.compile``
    imports it: nothing can be compiling before), then through torch's wrapper. Idempotent."""
    disabled = [f for f in vars(torch.optim.Optimizer).values() if getattr(f, "__code__", None) is _DISABLE_DYNAMO_CODE]
    steps = {cls: _unhooked(cls.__dict__.get("step")) for cls in _subclasses(torch.optim.Optimizer)}
    if not disabled or not any(
        getattr(s, "__code__", None) is _USE_GRAD_CODE or getattr(s, "until_compiling", False) for s in steps.values()
    ):
        raise UpstreamChangedError(
            f"torch {torch.__version__}: torch.optim.Optimizer's methods or its subclasses' steps are no longer "
            "wrapped by torch._disable_dynamo / _use_grad_for_differentiable; re-read torch/optim/optimizer.py and "
            "update compat.torch.optimizers_without_compiler"
        )
    for inner in disabled:
        cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__), strict=True))
        if getattr(cells["fn"], "__dynamo_disable", None) is None:
            setattr(cells["fn"], "__dynamo_disable", _disabled_once_compiling(cells["fn"], cells["recursive"]))
    for cls, use_grad in steps.items():
        if getattr(use_grad, "__code__", None) is not _USE_GRAD_CODE:
            continue  # no step of its own, or already lazy
        lazy = _grad_mode_until_compiling(use_grad)
        if getattr(cls.__dict__["step"], "hooked", False):  # the profiler's hooks torch puts on a built class's step
            lazy = torch.optim.Optimizer.profile_hook_step(lazy)
            lazy.hooked = True
        cls.step = lazy


def _subclasses(cls: type) -> list[type]:
    return [cls, *(s for sub in cls.__subclasses__() for s in _subclasses(sub))]


def _unhooked(step):
    """An optimizer class's own ``step`` without the profiler's hook that torch puts on it."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _disabled_once_compiling(fn, recursive: bool):
    """``fn`` while ``torch._dynamo`` is not imported; once it is, ``torch._dynamo.disable(fn)``, cached where
    ``torch._disable_dynamo`` caches it."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return fn(*args, **kwargs)
        expect_parameters(dynamo.disable, ("fn", "recursive", "reason", "wrapping"), "torch._dynamo.disable")
        disabled = dynamo.disable(fn, recursive, wrapping=False)
        setattr(fn, "__dynamo_disable", disabled)
        return disabled(*args, **kwargs)

    return call


def _grad_mode_until_compiling(use_grad):
    """An optimizer's ``step`` as ``_use_grad_for_differentiable`` runs it in eager mode (autograd on only for a
    differentiable optimizer; its two ``graph_break`` calls do nothing there) while ``torch._dynamo`` is not
    imported, through ``use_grad`` once it is."""
    step = use_grad.__wrapped__

    @functools.wraps(step)
    def call(self, *args, **kwargs):
        if "torch._dynamo" in sys.modules:
            return use_grad(self, *args, **kwargs)
        grad = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return step(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(grad)

    call.until_compiling = True
    return call
