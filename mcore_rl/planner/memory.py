"""Per-device memory of a run (colocated, or per device pool where the engines, a reward model or a judge have their
own), from the model's config.json and the run config alone (no model is built): what each role holds in each
phase of an episode, whether it fits a device, and which layouts would.

Everything is counted per device of the busiest pipeline rank:

* trainer: bf16 weights, fp32 gradients (``grad_reduce_in_fp32``), the distributed optimizer's fp32 main weights and
  Adam moments sharded over DP x CP (dense) or the expert-data-parallel group (experts), and the activations
  the pipeline schedule keeps alive (1F1B: ``pp - rank`` micro-batches; interleaved: Megatron's warm-up count);
* reference, teacher, reward model: bf16 weights; critic: as the trainer, with a value head for the LM head;
* rollout engine, and a judge's own: the ``gpu_memory_utilization`` share vLLM takes, of which weights and working
  memory, the rest KV cache (GQA: ``2 L kv_heads/TP d`` per token; MLA: the latent ``L (kv_lora + rope)``,
  replicated over TP).

Parameters are exact: :func:`stage_params` equals Megatron's meta-built model (checked by every dry run).
Activations count what autograd saves, layer by layer, for Megatron's modules: ``te`` (TransformerEngine, GPU) and
``local`` (Megatron's local modules with :mod:`models.attention`; the CPU build), balanced MoE routing assumed.
The ``local`` terms are checked against the tensors autograd saves on tiny models (``tests/planner``); the ``te``
terms follow what TransformerEngine's modules save and are not measured here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from mcore_rl.trainer.logprobs import LM_HEAD_CHUNK_BYTES, LM_HEAD_CHUNK_COPIES
from models.bridge import padded_vocab
from models.registry import get_bridge
from models.spec import moe_layers
from parallel.config import ParallelConfig, divisors

GiB = 1 << 30
BACKENDS = ("te", "local")


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
        )

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


def _attention_params(a: Architecture, tp: int) -> int:
    h, d = a.hidden, a.head_dim
    if a.mla:
        q_head = a.qk_dim + a.rope_dim
        q = h * a.q_lora + a.q_lora + a.q_lora * a.heads * q_head // tp if a.q_lora else h * a.heads * q_head // tp
        kv = h * (a.kv_lora + a.rope_dim) + a.kv_lora + a.kv_lora * a.heads * (a.qk_dim + a.v_dim) // tp
        return h + q + kv + a.heads * a.v_dim * h // tp
    qkv = (a.heads + 2 * a.kv_heads) * d
    return h + qkv * h // tp + (qkv // tp if a.qkv_bias else 0) + (2 * d if a.qk_norm else 0) + a.heads * d * h // tp


def layer_params(a: Architecture, moe: bool, parallel: ParallelConfig) -> tuple[int, int]:
    """(parameters, of which expert parameters) of one layer on one device."""
    tp, h = parallel.tp, a.hidden
    dense = _attention_params(a, tp) + h
    if not moe:
        return dense + 3 * a.ffn * h // tp, 0
    experts = a.experts // parallel.ep * 3 * a.moe_ffn * h // parallel.expert_tp
    return dense + a.experts * h + 3 * a.shared_ffn * h // tp + experts, experts


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
        per_layer = [layer_params(a, a.moe_layers[i], parallel) for i in layers]
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


# ---- activations ---------------------------------------------------------------------------------------------
def optimizer_shards(parallel: ParallelConfig, world: int) -> tuple[int, int]:
    """Over how many devices the distributed optimizer shards a dense parameter (its DP x CP group) and an expert
    parameter (its expert-data-parallel group): the ways its gradients are reduce-scattered."""
    return world // (parallel.tp * parallel.pp), world // (parallel.ep * parallel.expert_tp * parallel.pp)


def device_tokens(parallel: ParallelConfig, tokens: float) -> tuple[float, float]:
    """Of a micro-batch's ``tokens``: those one device holds (CP splits them), and those in its sequence-sharded
    (hidden-sized) tensors, which sequence parallelism splits over TP too."""
    t = tokens / parallel.cp
    return t, t / parallel.tp if parallel.sequence_parallel else t


def layer_activation_bytes(
    a: Architecture,
    moe: bool,
    parallel: ParallelConfig,
    tokens: int,
    backend: str,
    act_bytes: int,
    sequence: float = 0.0,
) -> float:
    """Bytes autograd keeps for one layer's backward, on one device, for a micro-batch of ``tokens`` (whole
    sequences; CP and sequence parallelism divide them here). Hidden-sized tensors are split over TP only with
    sequence parallelism; head- and FFN-sized ones always. ``sequence``: the token-weighted mean sequence length
    (the longest sample bounds it), which only the local build's CP attention mask depends on."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    tp, h = parallel.tp, a.hidden
    t, st = device_tokens(parallel, tokens)
    local = backend == "local"
    heads = a.heads // tp
    fp32 = 4 / act_bytes  # an fp32 element in activation elements
    norm = 2 if local else 1  # torch's RMSNorm keeps its input and normalised input; TE's the input (+ rstd)
    # attention block: the input norm and what the first projection keeps (TE: its fused norm's output)
    elems = st * (norm * h + fp32 + h)
    if a.mla:
        q_head = a.qk_dim + a.rope_dim
        # the latents stay sequence-sharded: the up projections gather them
        if a.q_lora:
            elems += st * ((norm + 1) * a.q_lora + fp32)  # query latent, its norm, the up projection's input
        elems += st * (a.kv_lora + a.rope_dim + norm * a.kv_lora + fp32)  # key/value latent, its norm
        if local:  # RoPE's cos/sin; q, k, v and output at the query head size; the projection's input copy
            core = 4 * a.rope_dim + heads * (4 * q_head + a.v_dim)
        else:  # rotated q and k, the up projection's output (k_nope, v), the attention output
            core = heads * (2 * q_head + a.qk_dim + 2 * a.v_dim)
        elems += t * (core + heads * fp32)
        if parallel.cp > 1:  # keys and values of the whole sequence, gathered, replace the local keys
            elems += t * heads * (parallel.cp * (q_head + a.v_dim) - q_head)
    else:
        d, kv = a.head_dim, a.kv_heads // tp
        elems += t * (heads + 2 * kv) * d  # the QKV output (values are views of it)
        if a.qk_norm:  # normalised q and k; the local norm keeps its input too, a copy when q spans groups
            copy = heads * d if local and kv > 1 else 0
            elems += t * (copy + (heads + kv) * d + (heads + kv) * fp32)
        rope = 4 * d if local else 0  # the local RoPE keeps cos and sin per call
        elems += t * (rope + (heads + kv) * d + heads * d + heads * fp32)  # rotated q, k; attention output
        elems += t * heads * d * local  # the local build's projection input is a copy of the output
        if parallel.cp > 1:  # keys and values of the whole sequence, gathered, replace the local keys
            elems += t * kv * d * (2 * parallel.cp - 1)
    if local and parallel.cp > 1:
        elems += t * sequence * fp32  # the mask of which gathered keys each local query sees
    # MLP block: the pre-MLP norm and what the next projection (or the router) keeps
    elems += st * (norm * h + fp32 + h)
    act = 5 if local else 3  # SwiGLU: fc1's output (2F) and the activation's (F); the local build keeps 2F more
    if not moe:
        return (elems + t * act * a.ffn / tp) * act_bytes
    elems += t * act * a.shared_ffn / tp
    routed = st * a.topk * parallel.expert_tp  # expert-token rows this device computes (balanced routing)
    elems += routed * (h + act * a.moe_ffn / parallel.expert_tp + fp32)
    routing_bytes = st * (10 * a.experts + 24 * a.topk + 16 * a.router_groups)  # scores, maps, indices
    weights = a.experts // parallel.ep * 3 * a.moe_ffn // parallel.expert_tp * h if local else 0  # stacked copy
    return (elems + weights) * act_bytes + routing_bytes


def head_activation_bytes(a: Architecture, parallel: ParallelConfig, tokens: int, backend: str, act_bytes: int):
    """Bytes the last stage keeps for the final norm, the output layer and the loss (the logits over V/TP in the
    model's dtype; per token the target and the chunked softmax's max, sum and mean logit: 8 + 3 x 4 bytes); with
    a value head, the whole sequence's hidden states it gathers and a value per token."""
    t, st = device_tokens(parallel, tokens)
    norm = 2 if backend == "local" else 1
    if a.value_head:
        return st * (norm + 1) * a.hidden * act_bytes + t * a.hidden * act_bytes + t * 8
    return (
        st * (norm + 1) * a.hidden * act_bytes
        + st * 4
        + t * (act_bytes * a.padded_vocab(parallel.tp) / parallel.tp + 20)
    )


def lm_head_backward_bytes(a: Architecture, parallel: ParallelConfig, tokens: int, param_bytes: int) -> float:
    """What the loss's backward adds on the last stage: the logits' gradient (the model's dtype) and the working
    set of one chunk of the fp32 softmax (:mod:`mcore_rl.trainer.logprobs`), never the whole micro-batch's."""
    t, _ = device_tokens(parallel, tokens)
    vocab_t = 0 if a.value_head else t * a.padded_vocab(parallel.tp) / parallel.tp
    return vocab_t * param_bytes + LM_HEAD_CHUNK_COPIES * min(LM_HEAD_CHUNK_BYTES, 4 * vocab_t)


# ---- roles and phases ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What a step asks of memory, from the run config."""

    micro_batch_tokens: int  # tokens of one micro-batch (a pack, or micro_batch_size x the longest sample)
    micro_batches: int  # per data-parallel rank and optimizer step
    recompute: bool = False  # full activation recomputation: a layer keeps only its input
    sequence: int = 0  # the longest sample (bounds the mean sequence length)

    @classmethod
    def from_config(cls, config) -> Workload:
        rt, m = config.runtime_args, config.models
        trainer = m.policy_trainer
        longest = config.longest_sample
        dp = trainer.parallel.dp(rt.trainer_devices)
        rows = rt.train_global_batch_size // dp
        if trainer.max_token_in_packing:
            tokens = trainer.max_token_in_packing
            micro_batches = max(1, math.ceil(rows * longest / tokens))
        else:
            tokens = trainer.micro_batch_size * longest
            micro_batches = rows // trainer.micro_batch_size
        return cls(tokens, micro_batches, trainer.recompute == "full", longest)


def in_flight(parallel: ParallelConfig, rank: int, micro_batches: int) -> float:
    """Micro-batches whose activations pipeline ``rank`` holds at once, in units of its whole stage."""
    pp, vpp = parallel.pp, parallel.vpp
    if vpp == 1:
        return min(pp - rank, micro_batches)
    warmup = (pp - rank - 1) * 2 + (vpp - 1) * pp + 1  # Megatron's interleaved warm-up, in model chunks
    return min(warmup, micro_batches * vpp) / vpp


@dataclass(frozen=True)
class TrainerMemory:
    weights: int
    grads: int
    optimizer: int
    activations: int  # peak of the step (the busiest pipeline rank)
    scoring: int  # forward-only log-probs: one layer's working set and the logits

    @property
    def static(self) -> int:
        return self.weights + self.grads + self.optimizer


def trainer_memory(
    a: Architecture,
    parallel: ParallelConfig,
    world: int,
    work: Workload,
    *,
    backend: str = "te",
    param_bytes: int = 2,
    lora=None,
    mtp_loss_coef: float = 0.0,
) -> TrainerMemory:
    """Per-device bytes of a trainer rank at ``parallel`` (the pipeline rank with the largest total); with ``lora``
    adapters (a LoRAConfig of rank > 0) only they have gradients and optimizer state. MTP layers train (gradients,
    optimizer state, their layer's activations and logits) only with ``mtp_loss_coef``."""
    dp_cp, expert_dp = optimizer_shards(parallel, world)
    opt_per_param = 8 + (4 if param_bytes != 4 else 0)  # Adam moments (+ fp32 main weights of bf16 parameters)
    tokens = work.micro_batch_tokens
    _, st = device_tokens(parallel, tokens)
    best = None
    for rank, ((params, experts), layers) in enumerate(
        zip(stage_params(a, parallel), rank_layers(parallel, a.layers), strict=True)
    ):
        per_layer = [
            layer_activation_bytes(a, a.moe_layers[i], parallel, tokens, backend, param_bytes, work.sequence)
            for i in layers
        ]
        layer_inputs = st * a.hidden * param_bytes
        kept = layer_inputs * len(layers) + max(per_layer) if work.recompute else sum(per_layer)
        acts = in_flight(parallel, rank, work.micro_batches) * kept
        head, frozen = 0.0, (0, 0)
        if rank == parallel.pp - 1:
            head = head_activation_bytes(a, parallel, tokens, backend, param_bytes)
            logits = lm_head_backward_bytes(a, parallel, tokens, param_bytes)
            acts += head + logits
            if a.mtp_layers and mtp_loss_coef:  # per MTP layer: a layer's activations and logits more
                mtp_layer = layer_activation_bytes(a, a.moe_layers[-1], parallel, tokens, backend, param_bytes)
                acts += a.mtp_layers * in_flight(parallel, rank, work.micro_batches) * (mtp_layer + logits)
            elif a.mtp_layers:
                frozen = mtp_params(a, parallel)
        if lora is not None and lora.rank:
            counts = [lora_params(a, a.moe_layers[i], parallel, lora) for i in layers]
            adapters, expert_adapters = sum(c for c, _ in counts), sum(e for _, e in counts)
            routers, copies = map(sum, zip(*(trained_router(a, a.moe_layers[i], lora) for i in layers), strict=True))
            params, trained, trained_experts = params + adapters + copies, adapters + routers, expert_adapters
        else:
            trained, trained_experts = params - frozen[0], experts - frozen[1]
        memory = TrainerMemory(
            weights=params * param_bytes,
            grads=trained * 4,
            optimizer=int(
                (trained - trained_experts) * opt_per_param / dp_cp + trained_experts * opt_per_param / expert_dp
            ),
            activations=int(acts),
            scoring=int(max(per_layer) + head * 2),
        )
        if best is None or memory.static + memory.activations > best.static + best.activations:
            best = memory
    return best


@dataclass(frozen=True)
class EngineMemory:
    share: int  # what vLLM takes: gpu_memory_utilization x device
    weights: int
    working: int  # activations and sampler at the engine's batch limits
    kv_bytes_per_token: int
    kv_tokens: int  # tokens the KV cache holds (negative: the share does not cover weights and working memory)


def engine_memory(a: Architecture, rollout, device_bytes: int, max_num_seqs: int = 256) -> EngineMemory:
    """One rollout engine's device share at ``rollout`` (a RolloutConfig): bf16 weights split over its TP, vLLM's
    profiled working memory (``max_num_batched_tokens`` of activations and ``max_num_seqs`` rows of sampler
    logits), and the KV cache in the rest."""
    tp = rollout.tensor_parallel_size
    share = int(rollout.gpu_memory_utilization * device_bytes)
    weights = a.engine_params(bool(rollout.speculative_tokens)) * 2 // tp
    batched = max(8192, rollout.max_model_len)
    mlp = a.topk * a.moe_ffn if a.experts else a.ffn
    working = batched * (16 * a.hidden + 6 * mlp // tp) + max_num_seqs * a.vocab * 12
    if a.mla:
        per_token = a.layers * (a.kv_lora + a.rope_dim) * 2
    else:
        per_token = 2 * a.layers * max(1, a.kv_heads // tp) * a.head_dim * 2
    return EngineMemory(share, weights, working, per_token, (share - weights - working) // per_token)


@dataclass(frozen=True)
class Phase:
    name: str
    parts: dict[str, int]  # what is resident, by owner

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryPlan:
    device_bytes: int
    trainer: TrainerMemory
    ref_weights: int  # 0 without a reference model
    engine: EngineMemory
    phases: list[Phase]
    problems: list[str]  # why it does not fit (empty: it fits)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


def plan_memory(
    config, device_bytes: int, *, backend: str = "te", reserve_bytes: int = 5 * GiB, arch: Architecture | None = None
) -> MemoryPlan:
    """Every phase of a colocated episode on one device of ``config`` (a RunConfig), with the trainer's offload as
    configured (:func:`mcore_rl.driver.learn` moves weights and optimizer state apart; the scoring roles and the
    critic leave whole; a reward model comes on during the rollout, beside the engines' share). ``reserve_bytes``
    stands for the CUDA context, NCCL buffers and allocator fragmentation."""
    m, world = config.models, config.runtime_args.trainer_devices
    a = arch or Architecture.from_bridge(get_bridge(m.policy_trainer.load))
    work = Workload.from_config(config)
    trainer = trainer_memory(
        a, m.policy_trainer.parallel, world, work, backend=backend, lora=m.policy_trainer.lora,
        mtp_loss_coef=m.policy_trainer.mtp_loss_coef,
    )  # fmt: skip

    def arch_of(load: str) -> Architecture:
        return a if load == m.policy_trainer.load else Architecture.from_bridge(get_bridge(load))

    def bf16_weights(section) -> int:  # a scoring role's weights on its busiest device
        return max(p for p, _ in stage_params(arch_of(section.load), section.parallel)) * 2

    scoring = {}  # bf16 weights of the roles that only score: name -> bytes
    for role, name in (("ref_policy", "reference weights"), ("teacher", "teacher weights")):
        if m.uses(role):
            scoring[name] = bf16_weights(getattr(m, role))
    rt = config.runtime_args
    own = []  # the phases of the pools of a reward model and a judge with devices of their own
    # a reward model scores conversations during the rollout, beside the engines
    reward_model = {"reward model weights": bf16_weights(m.reward_model)} if m.uses("reward_model") else {}
    if rt.reward_model_devices:
        own.append(Phase("score (reward model devices)", reward_model | {"reserve": reserve_bytes}))
        reward_model = {}
    judge, judge_engine = {}, None  # a judge's own engines beside the policy's: their share while those are awake
    if m.judge.own_engines:
        judge_arch = Architecture.from_bridge(get_bridge(m.judge.load))
        judge_engine = engine_memory(judge_arch, m.judge.engine_config(m.policy.rollout), device_bytes)
        judge = {"judge engine share": judge_engine.share}
        if rt.judge_devices:
            own.append(Phase("judge (judge devices)", judge | {"reserve": reserve_bytes}))
            judge = {}
    critic = None
    if m.uses("critic"):
        critic_arch = dataclasses.replace(arch_of(m.critic.load), value_head=True)  # its LM head is dropped
        critic = trainer_memory(critic_arch, m.critic.parallel, world, work, backend=backend)
    ref = scoring.get("reference weights", 0)
    engine = engine_memory(a, m.policy.rollout, device_bytes)
    if not rt.colocated:
        plan = _disaggregated(
            m, trainer, ref, scoring | reward_model, critic, engine, judge, device_bytes, reserve_bytes
        )
        return _with_pools(plan, own, judge_engine, m.judge.max_model_len)
    phases = _colocated_phases(m, trainer, critic, engine, scoring, reward_model, judge, reserve_bytes)
    plan = MemoryPlan(device_bytes, trainer, ref, engine, phases, _problems(m, phases, engine, device_bytes))
    return _with_pools(plan, own, judge_engine, m.judge.max_model_len)


def _colocated_phases(m, trainer, critic, engine, scoring: dict, reward_model: dict, judge: dict,
                      reserve_bytes: int) -> list[Phase]:  # fmt: skip
    """The phases of a colocated episode on one trainer device: rollout, log-probs, critic, train, sync."""
    offload = m.policy_trainer.offload
    resident = {"trainer (offloaded)": 0} if offload else {"trainer weights+grads+optimizer": trainer.static}
    # outside the step: with offload, the weights without the optimizer state and gradients
    weights_only = (
        {"trainer weights": trainer.weights} if offload else {"trainer weights+grads+optimizer": trainer.static}
    )
    critic_state = {"critic weights+grads+optimizer": critic.static} if critic else {}
    others = {} if offload else scoring | reward_model | critic_state
    # Every trainer rank keeps two sync buffers for the whole run (the first sync's allocation is reused).
    fixed = {"sync buffers": 2 * m.policy.sync.bucket_bytes, "reserve": reserve_bytes}
    phases = [
        # also the sync's probe: the engines' KV caches wake once the trainer's weights have left
        Phase("rollout", {"engine share": engine.share} | judge | resident | (others or reward_model) | fixed),
        Phase(  # with offload, the optimizer state stays off the device until the step; one scoring role at a time
            "log-probs",
            weights_only
            | (others or {"largest scoring role": max(scoring.values(), default=0)})
            | {"scoring": trainer.scoring}
            | fixed,
        ),
    ]
    if critic:
        whole = {"critic weights+grads+optimizer": critic.static}
        phases.append(Phase("critic", weights_only | others | whole | {"activations": critic.activations} | fixed))
    phases += [
        Phase(
            "train",
            {"trainer weights+grads+optimizer": trainer.static, "activations": trainer.activations} | others | fixed,
        ),
        # with offload, the optimizer state and gradients leave before the engine's weights arrive
        Phase("sync", weights_only | {"engine weights": engine.weights} | others | fixed),
    ]
    return phases


def _with_pools(plan: MemoryPlan, own: list[Phase], judge: EngineMemory | None, judge_len: int) -> MemoryPlan:
    """``plan`` with the phases of the devices of a reward model or judge of their own, and their problems; a
    judge's engine whose KV cache cannot hold its ``judge_len`` tokens of context is one."""
    problems = _over(own, plan.device_bytes)
    if judge is not None and judge.kv_tokens < judge_len:
        problems.append(
            f"judge: the KV cache holds {max(judge.kv_tokens, 0)} tokens per engine, below models.judge.max_model_len"
            f"={judge_len} (share {judge.share / GiB:.1f} GiB, weights {judge.weights / GiB:.1f}); raise "
            "models.judge.gpu_memory_utilization or tensor_parallel_size"
        )
    return dataclasses.replace(plan, phases=plan.phases + own, problems=plan.problems + problems)


def _disaggregated(
    m, trainer, ref: int, scoring: dict, critic, engine: EngineMemory, judge: dict, device_bytes: int, reserve: int
):
    """The phases of each pool when the engines have devices of their own: the trainer, the scoring roles and the
    critic stay resident on theirs (nothing else comes), rank 0 keeps one broadcast buffer; an engine device holds
    the engine's share alone, or beside a judge's engine share."""
    resident = {"trainer weights+grads+optimizer": trainer.static} | scoring
    if critic:
        resident["critic weights+grads+optimizer"] = critic.static
    fixed = {"sync buffer": m.policy.sync.bucket_bytes, "reserve": reserve}
    phases = [
        Phase("rollout (rollout devices)", {"engine share": engine.share} | judge | {"reserve": reserve}),
        Phase("log-probs", resident | {"scoring": trainer.scoring} | fixed),
        Phase(
            "train", resident | {"activations": max(trainer.activations, critic.activations if critic else 0)} | fixed
        ),
    ]
    return MemoryPlan(device_bytes, trainer, ref, engine, phases, _problems(m, phases, engine, device_bytes))


def _over(phases: list[Phase], device_bytes: int) -> list[str]:
    """The phases that do not fit the device, with their parts."""
    return [
        f"{p.name}: {p.total / GiB:.1f} GiB needed > {device_bytes / GiB:.1f} GiB ("
        + ", ".join(f"{k} {v / GiB:.1f}" for k, v in p.parts.items() if v)
        + ")"
        for p in phases
        if p.total > device_bytes
    ]


def _problems(m, phases: list[Phase], engine: EngineMemory, device_bytes: int) -> list[str]:
    problems = _over(phases, device_bytes)
    if engine.kv_tokens < m.policy.rollout.max_model_len:
        problems.append(
            f"rollout: the KV cache holds {max(engine.kv_tokens, 0)} tokens per engine, below max_model_len="
            f"{m.policy.rollout.max_model_len} (share {engine.share / GiB:.1f} GiB: weights "
            f"{engine.weights / GiB:.1f}, working {engine.working / GiB:.1f}); raise "
            "models.policy.rollout.gpu_memory_utilization or tensor_parallel_size"
        )
    return problems


def suggest_layouts(config, device_bytes: int, *, limit: int = 5, **kwargs) -> list[tuple[ParallelConfig, int]]:
    """Trainer layouts for ``config``'s model and devices that fit, best first: the least model parallelism (the
    most data parallelism), then fewer pipeline stages, then the lowest peak; each with its peak bytes."""
    a = Architecture.from_bridge(get_bridge(config.models.policy_trainer.load))
    world = config.runtime_args.trainer_devices
    found = []
    for tp in divisors(min(world, 8)):  # TP within a node
        for pp in [p for p in divisors(world // tp) if p <= a.layers]:
            for ep in divisors(a.experts) if a.experts else [1]:
                try:  # the run's own validation: the layout against the model and the devices
                    parallel = _layout(a, tp, pp, ep)
                    trial = _with_layout(config, parallel)
                    trial.validate()
                except ValueError:
                    continue
                plan = plan_memory(trial, device_bytes, arch=a, **kwargs)
                if plan.fits:
                    found.append((tp * pp, pp, plan.peak.total, parallel))
    found.sort(key=lambda f: f[:3])
    return [(parallel, peak) for _, _, peak, parallel in found[:limit]]


def _layout(a: Architecture, tp: int, pp: int, ep: int) -> ParallelConfig:
    base = dict(tp=tp, pp=pp, ep=ep, etp=1 if a.experts else None, sequence_parallel=tp > 1)
    if a.layers % pp:  # an uneven split: the remainder goes to the last stage (the output layer's)
        base["last_stage_layers"] = a.layers - -(-a.layers // pp) * (pp - 1)
    return ParallelConfig(**base)


def _with_layout(config, parallel: ParallelConfig):
    models = config.models
    trainer = dataclasses.replace(models.policy_trainer, parallel=parallel)
    ref = dataclasses.replace(models.ref_policy, parallel=parallel)
    critic = dataclasses.replace(models.critic, parallel=parallel)
    return dataclasses.replace(
        config, models=dataclasses.replace(models, policy_trainer=trainer, ref_policy=ref, critic=critic)
    )


def describe(plan: MemoryPlan, max_model_len: int) -> list[str]:
    """The plan as report lines: the roles' parts, then every phase's total against the device."""
    t, e = plan.trainer, plan.engine
    lines = [
        f"memory per device ({plan.device_bytes / GiB:.0f} GiB): trainer weights {t.weights / GiB:.1f}, grads "
        f"{t.grads / GiB:.1f}, optimizer {t.optimizer / GiB:.1f}, activations {t.activations / GiB:.1f} GiB"
        + (f"; reference weights {plan.ref_weights / GiB:.1f} GiB" if plan.ref_weights else ""),
        f"  rollout engine: share {e.share / GiB:.1f} GiB (weights {e.weights / GiB:.1f}, working "
        f"{e.working / GiB:.1f}), KV cache {max(e.kv_tokens, 0):,} tokens at {e.kv_bytes_per_token / 1024:.0f} "
        f"KiB each ({max(e.kv_tokens, 0) / max_model_len:.1f} sequences of max_model_len)",
        "  phases: " + ", ".join(f"{p.name} {p.total / GiB:.1f}" for p in plan.phases) + " GiB",
    ]
    return lines + [f"  does not fit: {problem}" for problem in plan.problems]


def device_bytes(config) -> int:
    """``runtime_args.device_memory_gb``, else the local GPU's memory; 0 on a machine without one."""
    if config.runtime_args.device_memory_gb:
        return int(config.runtime_args.device_memory_gb * GiB)
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


def check_fits(config) -> list[str]:
    """Why ``config`` cannot fit its devices, with layouts that would (empty: it fits, or no GPU to check)."""
    memory = device_bytes(config)
    if not memory:
        return []
    plan = plan_memory(config, memory)
    if plan.fits:
        return []
    return describe(plan, config.models.policy.rollout.max_model_len) + remedies(config, memory)


def remedies(config, memory: int) -> list[str]:
    """Trainer layouts that fit ``memory`` per device, best first, or what else to change."""
    suggestions = suggest_layouts(config, memory)
    if not suggestions:
        trainer = config.models.policy_trainer
        changes = ["add devices"] + (
            ["set models.policy_trainer.recompute=full"] if trainer.recompute != "full" else []
        )
        knob = "max_token_in_packing" if trainer.max_token_in_packing else "micro_batch_size"
        return [f"  no trainer layout fits: {', '.join(changes)}, or lower models.policy_trainer.{knob}"]
    return ["  trainer layouts that fit these devices (models.policy_trainer.parallel), best first:"] + [
        f"    {layout_text(p)}: peak {peak / GiB:.1f} GiB" for p, peak in suggestions
    ]


def layout_text(parallel: ParallelConfig) -> str:
    """``{tp: 2, sequence_parallel: true}``: the fields that differ from a single device, as YAML."""
    fields = {k: v for k, v in dataclasses.asdict(parallel).items() if v is not None and v is not False}
    return "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in fields.items() if v is True or v != 1) + "}"
