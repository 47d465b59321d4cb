"""Activation memory of one micro-batch on one device: what autograd saves, layer by layer, for Megatron's modules
(``te``: TransformerEngine, GPU; ``local``: Megatron's local modules with :mod:`models.attention`, the CPU build),
balanced MoE routing assumed, and the LM head's chunked log-prob pass. The ``local`` terms are checked against the
tensors autograd saves on tiny models (``tests/planner``); the ``te`` terms follow what TransformerEngine's modules
save and are not measured here."""

from __future__ import annotations

from mcore_rl.planner.params import Architecture
from mcore_rl.trainer.logprobs import LM_HEAD_CHUNK_BYTES, LM_HEAD_CHUNK_COPIES
from parallel.config import ParallelConfig

BACKENDS = ("te", "local")


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
