"""LoRA on Megatron's tensor-parallel linears: ``y = W x + scale * B A x`` with ``W`` frozen, ``A`` [r, in] and
``B`` [out, r] trained, sharded the way ``W`` is so that every layout computes what one rank would.

* Column-parallel base (``W_t`` [out/tp, in]: ``linear_qkv``, ``linear_fc1``, MLA's query and up projections):
  ``A`` is replicated and ``B_t``
  [out/tp, r] splits like ``W`` on its rows. The adapter reads the layer's whole input: under sequence parallelism
  gathered from the sequence shards (its gradient reduce-scattered back, as the base's is), and ``A``'s gradient,
  partial on each rank (each holds one block of ``B``), is summed over TP by Megatron's gradient finalisation (``A``
  is flagged as the sequence-parallel norms are). Without sequence parallelism ``h = A x`` passes an identity whose
  gradient is summed over TP, so ``A``'s gradient is whole on every rank.
* Row-parallel base (``W_t`` [out, in/tp], its input split over TP: ``linear_proj``, ``linear_fc2``): ``A_t``
  [r, in/tp] splits like ``W`` on its columns, ``B`` is replicated: ``h = sum_t A_t x_t`` (all-reduced), ``B h``
  on every rank, scattered to the sequence shards under sequence parallelism.

* Replicated base (``W`` [out, in] whole on every TP rank: MLA's ``linear_q_down_proj``, ``linear_kv_down_proj``,
  Megatron's ``Linear``): ``A`` and ``B`` whole, applied to the base's own input (under sequence parallelism its
  rank's tokens, so their gradients are summed over TP, as ``W``'s are).

* A routed expert's linear (``experts.linear_fc1``/``experts.linear_fc2``; expert-TP 1): ``A`` and ``B`` whole on
  the expert's EP rank, applied to that expert's tokens (by a hook, or by :class:`models.experts.GroupedExperts`'
  own forward), reduced over the expert-data-parallel ranks and checkpointed under the global expert's name.

* An MoE layer's router trains beside the adapters where ``train_router`` is set (its weight, and its expert bias
  where the balancing moves it): the reference policy then needs the router as loaded, which :class:`RouterCopy`
  keeps (a replicated copy, checkpointed with the adapters) and puts back while the adapters are off.

Merged weights are ``W_t + scale * B_t A`` (column), ``W_t + scale * B A_t`` (row) or ``W + scale * B A``
(replicated): local, no communication.
Adapters start as PEFT's (``A`` uniform in +-1/sqrt(in), ``B`` zero), each drawn whole from a generator seeded by
its layer's global name and then sharded, so every layout starts from the same adapters. They live in one
``lora`` module per model chunk (the base linears keep their names and checkpoint keys) and act through forward
hooks on the base linears; ``enabled`` off gives the base model (the reference policy without a copy of it).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from converters.mapping import MappingTable
from converters.peft import peft_tensors
from converters.plan import MTP, adapter_key, global_expert_name, local_params
from converters.transforms import shard
from parallel.comm import all_gather_bucket, all_gather_objects, broadcast_bucket, byte_buckets

KEY = "models.policy_trainer.lora"
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # attention, MLP (dense or shared experts)
# multi-latent attention's projections (its output is linear_proj): queries direct or through a latent, the latent
# of keys and values and its up projection
MLA = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
TARGETS = (*LINEARS, *MLA, "experts.linear_fc1", "experts.linear_fc2")  # and the routed experts' projections
EXPERTS = "experts."  # a routed expert's linear is targeted as experts.<its name>
ROUTER = "router"


@dataclass
class LoRAConfig:
    rank: int = 0  # 0: full fine-tuning
    alpha: float = 32.0  # the adapters' scale is alpha / rank
    # Megatron linears to adapt, by the last part of their name: linear_qkv, linear_proj (attention), linear_fc1,
    # linear_fc2 (the MLP, an MoE layer's shared experts); multi-latent attention's (MLA above); experts.linear_fc1,
    # experts.linear_fc2 (every routed expert's, with expert tensor parallelism 1)
    targets: list[str] = field(default_factory=lambda: list(LINEARS))
    dropout: float = 0.0  # PEFT's lora_dropout: of the adapters' input, while training (log-probs are scored without)
    # MoE models: the routers train too (full weights, beside the adapters); the reference keeps them as loaded
    train_router: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def settings(self) -> dict | None:
        """What a checkpoint records of its adapters (``lora.json``) and a run must match to continue from them."""
        if not self.rank:
            return None
        return {"rank": self.rank, "alpha": self.alpha} | ({"train_router": True} if self.train_router else {})

    def validate(self, prefix: str = KEY) -> None:
        if self.rank < 0 or (self.rank and not (math.isfinite(self.alpha) and self.alpha > 0)):
            raise ValueError(f"{prefix}: expected rank >= 0 and alpha > 0 (got rank {self.rank}, alpha {self.alpha})")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{prefix}.dropout={self.dropout}: expected a probability in [0, 1)")
        if unknown := sorted(set(self.targets) - set(TARGETS)):
            raise ValueError(f"{prefix}.targets: {unknown} are no adaptable linears; expected some of {list(TARGETS)}")
        if self.rank and not self.targets:
            raise ValueError(f"{prefix}.targets: empty; name the linears to adapt, or set rank: 0")
        if self.train_router and not self.rank:
            raise ValueError(f"{prefix}.train_router: LoRA's (rank 0 trains the whole model, routers included)")


def split_axis(split: str | None, factor: str) -> int | None:
    """The TP-split axis of an adapter's ``factor`` ("a" or "b") where its ``split`` factor is split (B's rows of a
    column-parallel weight, A's columns of a row-parallel one; None: a replicated weight's)."""
    return (0 if factor == "b" else 1) if factor == split else None


class Adapter(torch.nn.Module):
    """The adapter of one base linear (see the module docstring for the sharding)."""

    def __init__(
        self, base, slot: str, rank: int, scale: float, seed: int, tp_group, gated: bool = False, dropout: float = 0.0
    ):
        """``slot``: the base weight's global name (a routed expert's by its global index); ``gated``: the base is a
        gated MLP's ``linear_fc1``, whose rows hold [gate_t; up_t] on TP rank t. A routed expert's adapter
        (``tp_group``: expert-TP, of size 1) sees its expert's tokens alone, never sequence-parallel, and its
        gradients are reduced over the expert-data-parallel ranks, as its expert's are. ``dropout``: of the input,
        while training (:meth:`_drop`)."""
        super().__init__()
        self.dropout = dropout
        # the factor split over TP as W is: B's rows (column-parallel), A's columns (row-parallel), none (replicated)
        self.split = (
            "b" if isinstance(base, ColumnParallelLinear) else "a" if isinstance(base, RowParallelLinear) else None
        )
        self.column, self.gated = self.split == "b", gated
        self.expert = bool(getattr(base, "is_expert", False))
        weight = base.weight
        # a replicated linear under sequence parallelism sees its rank's tokens, as Megatron flags its weight
        sequence_parallel = base.sequence_parallel if self.split else getattr(weight, "sequence_parallel", False)
        self.sequence_parallel = sequence_parallel and not self.expert
        self.slot, self.scale, self.tp_group = slot, scale, tp_group
        self._base = [weight]  # not registered: the base model owns it
        tp, tp_rank = tp_group.size(), tp_group.rank()
        out_features = weight.shape[0] * (tp if self.split == "b" else 1)
        in_features = weight.shape[1] * (tp if self.split == "a" else 1)
        generator = torch.Generator().manual_seed(seed ^ zlib.crc32(slot.encode()))
        bound = 1 / math.sqrt(in_features)
        a = torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator)
        b = torch.zeros(out_features, rank)
        if self.split:  # split as W is
            a, b = (a, shard(b, 0, tp_rank, tp)) if self.column else (shard(a, 1, tp_rank, tp), b)
        self.a = torch.nn.Parameter(a.to(weight.device, weight.dtype))
        self.b = torch.nn.Parameter(b.to(weight.device, weight.dtype))
        if self.split:
            set_tensor_model_parallel_attributes(getattr(self, self.split), True, self.axis(self.split), 1)
        if self.column and self.sequence_parallel:  # A's gradient: partial per TP rank, summed by Megatron
            self.a.sequence_parallel = True
        if self.split is None and self.sequence_parallel:  # partial per TP rank (its tokens), as W's: summed
            self.a.sequence_parallel = self.b.sequence_parallel = True
        if self.expert:  # Megatron's DDP and optimizer: an expert-parallel parameter
            for param in (self.a, self.b):
                param.allreduce = False
        self.enabled = True

    def axis(self, factor: str) -> int | None:
        """The axis along which ``factor`` ("a" or "b") is split over TP; None: whole on every TP rank."""
        return split_axis(self.split, factor)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B A x`` shaped as the base linear's output, from its input ``x``."""
        group = self.tp_group
        if self.split is None:  # the base's own input, whole or this rank's sequence shard: no communication
            return self.scale * torch.nn.functional.linear(torch.nn.functional.linear(self._drop(x), self.a), self.b)
        if self.column:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, group=group)
            h = torch.nn.functional.linear(self._drop(x), self.a)
            if not self.sequence_parallel:
                h = copy_to_tensor_model_parallel_region(h, group=group)
            return self.scale * torch.nn.functional.linear(h, self.b)
        h = reduce_from_tensor_model_parallel_region(torch.nn.functional.linear(self._drop(x), self.a), group=group)
        y = self.scale * torch.nn.functional.linear(h, self.b)
        return scatter_to_sequence_parallel_region(y, group=group) if self.sequence_parallel else y

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """PEFT's dropout of the adapter's input, while training, drawn from Megatron's RNG trackers (activation
        recompute restores their states, so it redraws the same mask): an input every TP rank holds whole (a
        column-parallel linear's, gathered from the sequence shards) from the data-parallel stream, seeded alike
        over TP, so the TP ranks agree whatever stream is current where the hook runs (under sequence parallelism
        Megatron forks the tensor-parallel one around it); a row-parallel linear's TP shard from the
        tensor-parallel stream, one per rank; a routed expert's tokens from the expert-parallel one; a replicated
        linear's (MLA's down projections) as a column-parallel one's, or under sequence parallelism (its rank's
        tokens) as a row-parallel one's."""
        if not (self.dropout and self.training):
            return x
        tracker = get_cuda_rng_tracker()
        if self.expert:
            draw = tracker.fork(get_expert_parallel_rng_tracker_name())
        elif self.column or (self.split is None and not self.sequence_parallel):
            draw = tracker.fork(get_data_parallel_rng_tracker_name())
        else:
            draw = tracker.fork()  # the tensor-parallel stream
        with draw:
            return torch.nn.functional.dropout(x, self.dropout, training=True)

    @property
    def base_weight(self) -> torch.nn.Parameter:
        return self._base[0]

    def merged(self) -> torch.Tensor:
        """This rank's shard of ``W + scale * B A``, in the base weight's dtype."""
        weight = self.base_weight.detach()
        return weight + (self.scale * (self.b.detach() @ self.a.detach())).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Checkpoint keys of the adapter with its TP split (Megatron's default would call both replicated); a gated
        ``linear_fc1``'s B is stored as its weight is, gate and up apart, so any TP size loads it."""
        axis = {self.split: self.axis(self.split)} if self.split else {}
        state = self.state_dict(prefix="", keep_vars=True)
        dp_cp = parallel_state.get_expert_data_parallel_group() if self.expert else _dp_cp(metadata)
        out = make_sharded_tensors_for_checkpoint(
            state, prefix, axis, sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp
        )
        if self.gated:
            out[f"{prefix}b"] = apply_swiglu_sharded_factory(out[f"{prefix}b"], sharded_offsets)
        return out


def _dp_cp(metadata: dict | None):
    """The data-parallel group (with context parallelism) a replicated tensor's checkpoint replicas span."""
    return (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(with_context_parallel=True)


class RouterCopy(torch.nn.Module):
    """An MoE layer's router as loaded (its tensors that train or move: weight, bias, expert bias), for the reference
    policy of a run that trains the router (``train_router``): buffers (no optimizer takes them) named
    ``loaded_<name>``, as Megatron's expert-bias update takes any module with an ``expert_bias`` for a router."""

    TENSORS = ("weight", "bias", "expert_bias")

    def __init__(self, router: torch.nn.Module, slot: str, tp_group):
        super().__init__()
        self.slot, self.tp_group, self._router = slot, tp_group, [router]  # a list: not a submodule
        self.names = [name for name in self.TENSORS if getattr(router, name, None) is not None]
        for name in self.names:
            self.register_buffer(f"loaded_{name}", getattr(router, name).detach().clone())

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(the router's tensor, its copy as loaded) per name."""
        return [(getattr(self._router[0], name), getattr(self, f"loaded_{name}")) for name in self.names]

    def keep(self) -> None:
        """Copy the router as it is now (just loaded from a checkpoint that did not hold a copy)."""
        with torch.no_grad():
            for tensor, loaded in self._pairs():
                loaded.copy_(tensor)

    @contextlib.contextmanager
    def in_place(self):
        """The router as loaded for the block; as trained again after it."""
        pairs = self._pairs()
        trained = [tensor.detach().clone() for tensor, _ in pairs]
        with torch.no_grad():
            for tensor, loaded in pairs:
                tensor.copy_(loaded)
        try:
            yield
        finally:
            with torch.no_grad():
                for (tensor, _), saved in zip(pairs, trained, strict=True):
                    tensor.copy_(saved)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Replicated over TP and DP, as the router is."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {}, sharded_offsets, tp_group=self.tp_group, dp_cp_group=_dp_cp(metadata)
        )


class Adapters(torch.nn.ModuleDict):
    """A chunk's adapters (the ``lora`` module of its GPTModel), keyed by their base linear's global name
    (:func:`converters.plan.adapter_key`), and the copies of its trained routers (keyed by the router's); all
    checkpointed under the same keys in every layout."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        out = {}
        for key, adapter in self.items():
            out |= adapter.sharded_state_dict(f"{prefix}{key}.", sharded_offsets, metadata)
        return out


def _hook(adapter: Adapter):
    def forward_hook(module, args, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter.delta(args[0]), bias

    return forward_hook


def attach_lora(chunks: list[torch.nn.Module], config: LoRAConfig, seed: int, tp_group) -> int:
    """Freeze every parameter of ``chunks`` (but the routers' where ``config.train_router``) and adapt the
    ``config.targets`` linears: each chunk's GPTModel gains a ``lora`` module holding its adapters (keyed by the
    base weights' global names) and its trained routers' copies (taken as the model is now: :func:`keep_routers`
    after loading it). Returns the adapted count; a target that matches no linear of the model, or routers to
    train in a model without them, is a ``ValueError`` naming it."""
    slots = {id(lp.param): lp.slot for lp in local_params(chunks)}
    num_local = (chunks[0].config.num_moe_experts or 0) // parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    found = set()
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        gpt = next(m for m in chunk.modules() if isinstance(m, GPTModel))
        held = Adapters()
        for name, module in gpt.named_modules():
            expert = getattr(module, "is_expert", False)
            target = EXPERTS * expert + name.rsplit(".", 1)[-1]
            linear = isinstance(module, ColumnParallelLinear | RowParallelLinear | Linear)
            # the MTP layers (models/mtp.py) stay the checkpoint's under LoRA: they do not run in its steps
            if name.startswith(MTP):
                continue
            if config.train_router and isinstance(module, TopKRouter):
                slot = slots[id(module.weight)].removesuffix(".weight")
                held[adapter_key(slot)] = RouterCopy(module, slot, tp_group)
                for param in module.parameters(recurse=False):
                    param.requires_grad_(True)
                found.add(ROUTER)
            if target not in config.targets or not linear:
                continue
            slot = slots[id(module.weight)].removesuffix(".weight")
            group = tp_group
            if expert:
                slot, group = (
                    global_expert_name(slot, ep_rank, num_local),
                    parallel_state.get_expert_tensor_parallel_group(),
                )
                if group.size() > 1:
                    raise ValueError(f"{KEY}.targets: {target} needs expert tensor parallelism 1 (parallel.etp)")
            gated = target.endswith("linear_fc1") and module.config.gated_linear_unit
            adapter = Adapter(module, slot, config.rank, config.scale, seed, group, gated, config.dropout)
            module.register_forward_hook(_hook(adapter))  # GroupedExperts adds expert adapters in its own forward
            module.lora_adapter = [adapter]  # a list: not a submodule of the base
            held[adapter_key(slot)] = adapter
            found.add(target)
        gpt.lora = held
    if missing := sorted(set(config.targets) - found):
        raise ValueError(f"{KEY}.targets: {missing} match no linear of this model; remove them")
    if config.train_router and ROUTER not in found:
        raise ValueError(f"{KEY}.train_router: this model has no MoE router to train; set it false")
    return len(adapters(chunks))


def _gpts(chunks: list[torch.nn.Module]) -> list[GPTModel]:
    return [next(m for m in chunk.modules() if isinstance(m, GPTModel)) for chunk in chunks]


def _lora_modules(chunks: list[torch.nn.Module], kind: type) -> dict:
    return {m.slot: m for gpt in _gpts(chunks) for m in getattr(gpt, "lora", {}).values() if isinstance(m, kind)}


def adapters(chunks: list[torch.nn.Module]) -> dict[str, Adapter]:
    """This rank's adapters by their base linear's global name."""
    return _lora_modules(chunks, Adapter)


def router_copies(chunks: list[torch.nn.Module]) -> dict[str, RouterCopy]:
    """This rank's copies of its trained routers (``train_router``) by the router's global name."""
    return _lora_modules(chunks, RouterCopy)


def keep_routers(chunks: list[torch.nn.Module]) -> None:
    """Take the trained routers' copies from the model as loaded (a checkpoint without them: they start here)."""
    for copy in router_copies(chunks).values():
        copy.keep()


@contextlib.contextmanager
def adapters_off(chunks: list[torch.nn.Module]):
    """The base model for the block (its routers as loaded, where they train): the reference policy of a LoRA
    run."""
    found = adapters(chunks).values()
    with contextlib.ExitStack() as routers:
        for copy in router_copies(chunks).values():
            routers.enter_context(copy.in_place())
        for adapter in found:
            adapter.enabled = False
        try:
            yield
        finally:
            for adapter in found:
                adapter.enabled = True


def merged(chunks: list[torch.nn.Module]):
    """What each parameter of ``chunks`` exports as (:func:`converters.stream.export_hf`'s ``read``): an adapted
    weight's shard merged with its adapter, computed when read; any other, itself."""
    by_weight = {id(a.base_weight): a for a in adapters(chunks).values()}

    def read(param: torch.Tensor) -> torch.Tensor:
        adapter = by_weight.get(id(param))
        return param.detach() if adapter is None else adapter.merged()

    return read


def export_peft(chunks: list[torch.nn.Module], bridge, groups, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every adapter as PEFT tensors (:mod:`converters.peft`), whole on every rank, stage by stage: per bucket of
    at most ``bucket_bytes``, one all_gather of the TP-split factors (B of a column-parallel weight, A of a
    row-parallel one) and one broadcast over PP. Yielded tensors may alias the adapters: copy them before the
    model moves on. Routed experts' adapters have no PEFT form (refused by name)."""
    mine = adapters(chunks)
    if experts := sorted(slot for slot, a in mine.items() if a.expert):
        raise ValueError(f"{KEY}.targets: adapters of routed experts ({experts[0]}, ...) have no PEFT form")
    table, tp = MappingTable(bridge.mappings()), groups.tp.size()
    layout = [(slot, a.split, tuple(a.a.shape), tuple(a.b.shape), a.a.dtype) for slot, a in sorted(mine.items())]
    device = next(chunks[0].parameters()).device

    def whole(split: str | None, factor: str, shape: tuple) -> torch.Size:
        axis = split_axis(split, factor)
        return torch.Size(s * (tp if i == axis else 1) for i, s in enumerate(shape))

    for owner, stage in enumerate(all_gather_objects(layout, groups.pp)):
        # consecutive adapters up to ``bucket_bytes`` of whole factors (a bound: one factor is whole already)
        for bucket in byte_buckets(
            stage, lambda e: (math.prod(e[2]) + math.prod(e[3])) * tp * e[4].itemsize, bucket_bytes
        ):
            shapes = [whole(split, f, shape) for _, split, a, b, _ in bucket for f, shape in (("a", a), ("b", b))]
            tensors = None
            if groups.pp.rank() == owner:
                split = [getattr(mine[slot], factor) for slot, factor, *_ in bucket if factor]
                gathered = iter(zip(*all_gather_bucket([t.detach() for t in split], groups.tp), strict=True))
                tensors = []
                for slot, factor, *_ in bucket:  # the split factor's shards joined, the other as it is
                    adapter = mine[slot]
                    for name in ("a", "b"):
                        own = getattr(adapter, name).detach()
                        tensors.append(torch.cat(next(gathered), dim=adapter.axis(name)) if name == factor else own)
            tensors = broadcast_bucket(tensors, shapes, bucket[0][4], owner, groups.pp, device)
            for i, (slot, split, *_) in enumerate(bucket):
                mapping, captures = table.resolve(f"{slot}.weight")
                # B's rows as the weight's: laid out per TP rank where it is split, whole where it is replicated
                yield from peft_tensors(mapping, captures, tensors[2 * i], tensors[2 * i + 1], tp if split else 1)
