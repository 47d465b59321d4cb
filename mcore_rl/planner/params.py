"""A model's parameters per device under a parallel layout, from its config alone (no model is built): per pipeline
stage, per layer kind (dense, MoE, MTP), LoRA's adapters, and the distributed optimizer's shard groups. Exact:
:func:`stage_params` equals Megatron's meta-built model (checked by every dry run). The memory plan and the
step-time model count from these."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.bridge import padded_vocab
from models.spec import linear_attention_layers, moe_layers
from parallel.config import ParallelConfig


@dataclass(frozen=True)
class Architecture:
    """The shapes memory depends on, read from a bridge's Megatron config (every family through its own
    declaration; no per-family code here)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    qkv_bias: bool
    vocab: int
    tied: bool
    moe_layers: tuple[bool, ...]
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    router_groups: int = 1
    expert_bias: bool = False  # a routing bias per expert: a buffer in Megatron, a tensor of the checkpoint
    mla: bool = False
    q_lora: int = 0  # 0: MLA queries without a low-rank projection
    kv_lora: int = 0
    qk_dim: int = 0  # MLA: the non-rotary part of a query/key head
    rope_dim: int = 0
    v_dim: int = 0
    value_head: bool = False  # a value head ([1, hidden]) for the LM head: a reward model or a critic
    mtp_layers: int = 0  # multi-token-prediction layers (models/mtp.py), on the last pipeline stage
    attention_gate: bool = False  # a sigmoid output gate per query head, projected with the queries
    linear_bias: bool = False  # biases of the output projection, the MLPs (each expert's) and the router (gpt-oss)
    sinks: bool = False  # a learned attention sink per head (``softmax_offset``)
    shared_gate: bool = False  # the shared expert's output scaled by a sigmoid gate ([1, hidden])
    # Gated DeltaNet (linear attention) layers (models/gated_delta.py): which, and their heads and convolution width
    linear_layers: tuple[bool, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv: int = 0

    @classmethod
    def from_bridge(cls, bridge) -> Architecture:
        c = bridge.transformer_config(ParallelConfig(), params_dtype=torch.bfloat16)
        mla = getattr(c, "multi_latent_attention", False)
        return cls(
            layers=c.num_layers,
            hidden=c.hidden_size,
            ffn=c.ffn_hidden_size,
            heads=c.num_attention_heads,
            kv_heads=c.num_query_groups,
            head_dim=c.kv_channels,
            qk_norm=c.qk_layernorm,
            qkv_bias=c.add_qkv_bias,
            vocab=bridge.vocab_size,
            tied=bridge.tie_word_embeddings,
            moe_layers=tuple(moe_layers(c)),
            experts=c.num_moe_experts or 0,
            topk=c.moe_router_topk if c.num_moe_experts else 0,
            moe_ffn=c.moe_ffn_hidden_size or 0,
            shared_ffn=c.moe_shared_expert_intermediate_size or 0,
            router_groups=c.moe_router_num_groups or 1,
            expert_bias=bool(c.moe_router_enable_expert_bias),
            mla=mla,
            q_lora=(c.q_lora_rank or 0) if mla else 0,
            kv_lora=c.kv_lora_rank if mla else 0,
            qk_dim=c.qk_head_dim if mla else 0,
            rope_dim=c.qk_pos_emb_head_dim if mla else 0,
            v_dim=c.v_head_dim if mla else 0,
            value_head=bridge.value_model,
            mtp_layers=c.mtp_num_layers or 0,
            attention_gate=c.attention_output_gate,
            linear_bias=c.add_bias_linear,
            sinks=c.softmax_type == "learnable",
            shared_gate=bool(c.moe_shared_expert_gate and c.moe_shared_expert_intermediate_size),
            linear_layers=tuple(linear_attention_layers(c)),
            linear_key_heads=c.linear_num_key_heads,
            linear_value_heads=c.linear_num_value_heads,
            linear_key_dim=c.linear_key_head_dim,
            linear_value_dim=c.linear_value_head_dim,
            linear_conv=c.linear_conv_kernel_dim,
        )

    def linear(self, layer: int) -> bool:
        """Whether global layer ``layer`` is Gated DeltaNet."""
        return bool(self.linear_layers) and self.linear_layers[layer]

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab(self.vocab, tp)

    def hf_params(self) -> int:
        """Parameters of the HF checkpoint: the model's, and its MTP layers' with their copies of the embedding and
        the head."""
        total = sum(params for params, _ in stage_params(self, ParallelConfig()))
        padding = (self.padded_vocab(1) - self.vocab) * self.hidden * (1 if self.tied else 2)
        moe_layers = sum(self.moe_layers) + (self.mtp_layers if self.moe_layers[-1] else 0)
        copies = 2 * self.mtp_layers * self.vocab * self.hidden
        return total - padding + copies + (self.experts * moe_layers if self.expert_bias else 0)

    def engine_params(self, drafts: bool = False) -> int:
        """Parameters a rollout engine holds: the checkpoint's but the MTP layers, which only an engine that drafts
        with them holds (``drafts``; their copies of the embedding and head are the model's)."""
        mtp, _ = mtp_params(self, ParallelConfig())
        bias = self.experts * self.mtp_layers if self.expert_bias and self.moe_layers[-1] else 0
        return self.hf_params() - (0 if drafts else mtp + bias) - 2 * self.mtp_layers * self.vocab * self.hidden


# ---- parameters ----------------------------------------------------------------------------------------------
def rank_layers(parallel: ParallelConfig, layers: int) -> list[list[int]]:
    """Global indices of the layers each pipeline rank holds (all its virtual stages)."""
    counts = parallel.stage_layers(layers)
    if parallel.vpp == 1:
        starts = [sum(counts[:r]) for r in range(parallel.pp)]
        return [list(range(s, s + n)) for s, n in zip(starts, counts, strict=True)]
    chunk = layers // (parallel.pp * parallel.vpp)
    return [
        [v * layers // parallel.vpp + r * chunk + i for v in range(parallel.vpp) for i in range(chunk)]
        for r in range(parallel.pp)
    ]


def _linear_attention_params(a: Architecture, tp: int) -> int:
    """Gated DeltaNet: input norm, ``in_proj`` (q, k, v, z, b, a), the depthwise convolution of q, k and v, dt_bias and
    A_log per value head, the output norm of a value head, ``out_proj``."""
    h, qk, v, heads = (
        a.hidden,
        a.linear_key_heads * a.linear_key_dim,
        a.linear_value_heads * a.linear_value_dim,
        a.linear_value_heads,
    )
    in_proj = (2 * qk + 2 * v + 2 * heads) * h // tp
    return h + in_proj + (2 * qk + v) * a.linear_conv // tp + 2 * heads // tp + a.linear_value_dim + v * h // tp


def _attention_params(a: Architecture, tp: int, linear: bool = False) -> int:
    h, d = a.hidden, a.head_dim
    if linear:
        return _linear_attention_params(a, tp)
    if a.mla:
        q_head = a.qk_dim + a.rope_dim
        q = h * a.q_lora + a.q_lora + a.q_lora * a.heads * q_head // tp if a.q_lora else h * a.heads * q_head // tp
        kv = h * (a.kv_lora + a.rope_dim) + a.kv_lora + a.kv_lora * a.heads * (a.qk_dim + a.v_dim) // tp
        return h + q + kv + a.heads * a.v_dim * h // tp
    qkv = (a.heads * (2 if a.attention_gate else 1) + 2 * a.kv_heads) * d
    extras = (qkv // tp if a.qkv_bias else 0) + (2 * d if a.qk_norm else 0) + (a.heads // tp if a.sinks else 0)
    return h + qkv * h // tp + extras + a.heads * d * h // tp + (h if a.linear_bias else 0)


def layer_params(a: Architecture, moe: bool, parallel: ParallelConfig, linear: bool = False) -> tuple[int, int]:
    """(parameters, of which expert parameters) of one layer on one device; ``linear``: a Gated DeltaNet layer."""
    tp, h, bias = parallel.tp, a.hidden, a.linear_bias
    dense = _attention_params(a, tp, linear) + h
    if not moe:
        return dense + 3 * a.ffn * h // tp + (2 * a.ffn // tp + h if bias else 0), 0
    etp = parallel.expert_tp
    expert = 3 * a.moe_ffn * h // etp + (2 * a.moe_ffn // etp + h if bias else 0)
    experts = a.experts // parallel.ep * expert
    shared = 3 * a.shared_ffn * h // tp + (h if a.shared_gate else 0)
    router = a.experts * (h + bias)
    return dense + router + shared + experts, experts


def adaptable_linears(a: Architecture, moe: bool) -> set[str]:
    """The LoRA targets (models/lora.py) a layer has: MLA has its own projections for ``linear_qkv`` (queries
    direct or through a latent); an MoE layer's ``linear_fc1`` and ``linear_fc2`` are its shared experts',
    ``experts.linear_fc1`` and ``experts.linear_fc2`` its routed experts'."""
    mlp = {"linear_fc1", "linear_fc2"} if a.shared_ffn or not moe else set()
    experts = {"experts.linear_fc1", "experts.linear_fc2"} if moe else set()
    queries = {"linear_q_down_proj", "linear_q_up_proj"} if a.q_lora else {"linear_q_proj"}
    attention = queries | {"linear_kv_down_proj", "linear_kv_up_proj"} if a.mla else {"linear_qkv"}
    return {"linear_proj"} | attention | mlp | experts


def lora_params(a: Architecture, moe: bool, parallel: ParallelConfig, lora) -> tuple[int, int]:
    """(LoRA adapter parameters, of which routed experts') of one layer on one device (models/lora.py): a
    column-parallel linear's A [r, in] whole and B [out/tp, r], a row-parallel one's A [r, in/tp] and B [out, r]
    whole, a replicated one's (MLA's down projections) both whole; each local routed expert's A and B whole
    (expert-TP 1)."""
    if not lora.rank:
        return 0, 0
    tp, h, r = parallel.tp, a.hidden, lora.rank
    ffn = a.shared_ffn if moe else a.ffn
    shapes = {
        "linear_qkv": (h, (a.heads + 2 * a.kv_heads) * a.head_dim // tp),
        "linear_proj": (a.heads * (a.v_dim if a.mla else a.head_dim) // tp, h),
        "linear_fc1": (h, 2 * ffn // tp),
        "linear_fc2": (ffn // tp, h),
        "linear_q_proj": (h, a.heads * (a.qk_dim + a.rope_dim) // tp),
        "linear_q_down_proj": (h, a.q_lora),
        "linear_q_up_proj": (a.q_lora, a.heads * (a.qk_dim + a.rope_dim) // tp),
        "linear_kv_down_proj": (h, a.kv_lora + a.rope_dim),
        "linear_kv_up_proj": (a.kv_lora, a.heads * (a.qk_dim + a.v_dim) // tp),
    }
    local = a.experts // parallel.ep
    experts = {"experts.linear_fc1": (h, 2 * a.moe_ffn), "experts.linear_fc2": (a.moe_ffn, h)}
    targets = adaptable_linears(a, moe) & set(lora.targets)
    dense = sum(r * (inp + out) for name, (inp, out) in shapes.items() if name in targets)
    routed = sum(local * r * (inp + out) for name, (inp, out) in experts.items() if name in targets)
    return dense + routed, routed


def trained_router(a: Architecture, moe: bool, lora) -> tuple[int, int]:
    """(the router parameters [experts, hidden] a LoRA run trains in one layer (``train_router``), the elements of
    the reference's copy of the router as loaded (models.lora.RouterCopy): those and the expert bias)."""
    if not (moe and lora.train_router):
        return 0, 0
    return a.experts * a.hidden, a.experts * a.hidden + (a.experts if a.expert_bias else 0)


def mtp_params(a: Architecture, parallel: ParallelConfig) -> tuple[int, int]:
    """(parameters, expert parameters) of the MTP layers on a device of the last pipeline rank: each a decoder layer
    of the last layer's kind, norms of the embedding, the hidden state and the output, and the column-parallel
    projection [hidden, 2 hidden]."""
    params, experts = layer_params(a, a.moe_layers[-1], parallel)
    own = 3 * a.hidden + 2 * a.hidden * a.hidden // parallel.tp
    return a.mtp_layers * (params + own), a.mtp_layers * experts


def stage_params(a: Architecture, parallel: ParallelConfig) -> list[tuple[int, int]]:
    """Per pipeline rank: (parameters, expert parameters) one of its devices holds, tied copies included (the
    embedding's copy on the last rank for its MTP layers too)."""
    vocab = a.padded_vocab(parallel.tp) * a.hidden // parallel.tp
    out = []
    for rank, layers in enumerate(rank_layers(parallel, a.layers)):
        per_layer = [layer_params(a, a.moe_layers[i], parallel, a.linear(i)) for i in layers]
        total, experts = sum(p for p, _ in per_layer), sum(e for _, e in per_layer)
        if rank == 0:
            total += vocab
        if rank == parallel.pp - 1:  # the final norm and the LM head (its tied copy under PP), or a value head
            head = a.hidden if a.value_head else (vocab if not a.tied or parallel.pp > 1 else 0)
            mtp, mtp_experts = mtp_params(a, parallel)
            copy = vocab if a.mtp_layers and parallel.pp > 1 else 0
            total, experts = total + a.hidden + head + mtp + copy, experts + mtp_experts
        out.append((total, experts))
    return out


def layer_tensors(a: Architecture, moe: bool, parallel: ParallelConfig, linear: bool = False) -> int:
    """Parameter tensors of one layer on one device, however TP shards them: what an optimizer step, the gradient
    clipping and the gradient buffers walk one by one (their fixed cost per step)."""
    if linear:  # norm, in_proj, conv1d, dt_bias, A_log, output norm, out_proj
        attention = 7
    elif a.mla:  # norm; queries (down, norm, up, or one projection); keys and values (down, norm, up); output
        attention = 1 + (3 if a.q_lora else 1) + 3 + 1
    else:  # norm, fused QKV (and its bias), query and key norms, sinks, output (and its bias)
        attention = 1 + 1 + a.qkv_bias + 2 * a.qk_norm + a.sinks + 1 + a.linear_bias
    per_linear = 1 + a.linear_bias  # a weight, and its bias where linears have biases
    if not moe:
        return attention + 1 + 2 * per_linear  # norm, fc1, fc2
    shared = (2 + a.shared_gate) if a.shared_ffn else 0
    # norm, router, experts, shared expert
    return attention + 1 + per_linear + 2 * per_linear * (a.experts // parallel.ep) + shared


def stage_tensors(a: Architecture, parallel: ParallelConfig) -> list[int]:
    """Per pipeline rank: the parameter tensors one of its devices holds (:func:`stage_params`' tensors)."""
    out = []
    for rank, layers in enumerate(rank_layers(parallel, a.layers)):
        tensors = sum(layer_tensors(a, a.moe_layers[i], parallel, a.linear(i)) for i in layers) + (rank == 0)
        if rank == parallel.pp - 1:  # final norm; the LM head (its tied copy under PP) or a value head; MTP layers
            head = a.value_head or not a.tied or parallel.pp > 1
            mtp = a.mtp_layers * (layer_tensors(a, a.moe_layers[-1], parallel) + 4)  # 3 norms, the projection
            tensors += 1 + head + mtp + (a.mtp_layers > 0 and parallel.pp > 1)
        out.append(tensors)
    return out


# ---- activations ---------------------------------------------------------------------------------------------
def optimizer_shards(parallel: ParallelConfig, world: int) -> tuple[int, int]:
    """Over how many devices the distributed optimizer shards a dense parameter (its DP x CP group) and an expert
    parameter (its expert-data-parallel group): the ways its gradients are reduce-scattered."""
    return world // (parallel.tp * parallel.pp), world // (parallel.ep * parallel.expert_tp * parallel.pp)
