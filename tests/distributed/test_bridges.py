"""HF <-> Megatron for every family across TP/PP/VPP/EP layouts, on a pool of 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.distributed import cases
from tests.tiny import FAMILIES, MOONLIGHT, make_tiny

DENSE_LAYOUTS = [
    dict(tp=1, pp=1),
    dict(tp=2, pp=1),
    dict(tp=1, pp=2),
    dict(tp=2, pp=2),
    dict(tp=1, pp=2, vpp=2),
    dict(pp=2, last_stage_layers=1),
]
EXPERT_LAYOUTS = [dict(ep=2), dict(tp=2, ep=2, sequence_parallel=True)]
MOE = (
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
)


def dense_layouts(arch) -> list[dict]:
    """The dense layouts a round trip checks ``arch``'s mapping under: Qwen3.5's model and parameter names are
    Qwen3-Next's but for its Gated DeltaNet input tensors, which TP alone splits (its pipelines are Qwen3-Next's)."""
    return [dict(tp=1), dict(tp=2)] if arch == "Qwen3_5MoeForCausalLM" else DENSE_LAYOUTS


def _layouts(arch, layouts):
    """``layouts`` as ``arch`` can run them, plus the expert-parallel ones for the MoE families."""
    if arch not in MOE:
        return layouts
    # MoE with TP needs sequence parallelism (a Megatron rule the layout validation enforces); gpt-oss's expert
    # biases, experts without TP (Megatron's rule), and so expert parallelism beside TP.
    etp = dict(etp=1, ep=2) if arch == "GptOssForCausalLM" else {}
    layouts = [dict(lay, sequence_parallel=True) if lay.get("tp", 1) > 1 else lay for lay in layouts] + EXPERT_LAYOUTS
    return [dict(lay, **etp) if lay.get("tp", 1) > 1 else lay for lay in layouts]


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_roundtrip_bit_exact(ranks, tiny_models, arch):
    for layout in _layouts(arch, dense_layouts(arch)):
        # A 64 KiB bucket splits every model into several buckets; the rest use one big bucket.
        for bucket in (64 << 10, 512 << 20):
            counts = ranks.run(cases.roundtrip, hf_dir=tiny_models[arch], layout=layout, bucket_bytes=bucket)
            assert len(set(counts)) == 1 and counts[0] > 0, (layout, counts)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_logits_match_hf(ranks, tiny_models, arch):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids).logits
    for layout in _layouts(arch, [dict(tp=1), dict(tp=2)]):
        for got in ranks.run(cases.logits, hf_dir=tiny_models[arch], layout=layout, input_ids=ids):
            assert (got - reference).abs().max().item() <= 1e-4, layout


def _hf_step_reference(hf_dir, tokens):
    """Single-process HF transformers: mean token cross-entropy and its gradient norm on the whole batch."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    logits = model(tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return loss.item(), grad_norm.item()


STEP_LAYOUTS = [
    dict(tp=2, sequence_parallel=True),
    dict(pp=2),
    dict(pp=2, first_stage_layers=3),
    dict(pp=2, vpp=2),
    dict(tp=2, pp=2),
]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", *MOE])
def test_train_step_matches_single_rank(ranks, tiny_models, arch):
    tokens = torch.randint(0, 100, (8, 17), generator=torch.Generator().manual_seed(2))
    ref_loss, ref_norm = _hf_step_reference(tiny_models[arch], tokens)
    # gpt-oss's own parts (sinks and biases split by TP, experts by EP) under TP and EP, its PP every family's; Qwen3.5's
    # model is Qwen3-Next's (so are its pipeline layouts): its own mapping under TP and EP
    own = {"GptOssForCausalLM": [dict(), dict(pp=2, vpp=2)], "Qwen3_5MoeForCausalLM": [dict()]}
    dense = own.get(arch, [dict(), *STEP_LAYOUTS])
    for layout in _layouts(arch, dense):
        for loss, norm in ranks.run(
            cases.train_step, hf_dir=tiny_models[arch], layout=layout, tokens=tokens, micro_batch_size=1
        ):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (layout, loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (layout, norm, ref_norm)


def test_moonlight_shaped_mla_matches_hf(ranks, tmp_path):
    """DeepSeek-V3's other shape (Moonlight-16B-A3B): no query LoRA, plain RoPE, one expert group; saved with
    rotate-half rotary rows (rope_interleave=False), which the mappings permute."""
    hf_dir = make_tiny("DeepseekV3ForCausalLM", tmp_path / "moonlight", **MOONLIGHT, rope_interleave=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids).logits
    for layout in (dict(tp=2, sequence_parallel=True), dict(ep=2)):
        for got in ranks.run(cases.logits, hf_dir=str(hf_dir), layout=layout, input_ids=ids):
            assert (got - reference).abs().max().item() <= 1e-4, layout
    for layout in (dict(tp=2, ep=2, sequence_parallel=True), dict(pp=2)):
        counts = ranks.run(cases.roundtrip, hf_dir=str(hf_dir), layout=layout, bucket_bytes=64 << 10)
        assert len(set(counts)) == 1 and counts[0] > 0, (layout, counts)


# GLM-4.5's and Qwen3-Next's experts are DeepSeek-V3's and Qwen3-MoE's; gpt-oss's have biases, a clamp and an offset
@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "GptOssForCausalLM", "Qwen3MoeForCausalLM"])
def test_grouped_experts_match_sequential(ranks, tiny_models, arch):
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(5))
    for layout in _layouts(arch, [dict()]):
        for diffs in ranks.run(
            cases.experts_grouped_vs_sequential, hf_dir=tiny_models[arch], layout=layout, tokens=tokens
        ):
            assert diffs["loss"] <= 1e-6 and diffs["grads"] <= 1e-6 and diffs["module"] <= 1e-5, (layout, diffs)
            assert diffs["chosen"] == [False]  # on CPU the device chose Megatron's loop; the kernel was forced


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "DeepseekV3ForCausalLM"])  # GQA with qk-norm; MLA
def test_context_parallel_matches_single_rank(ranks, tiny_models, arch):
    """CP=2 (load-balanced chunks, K/V all-gathered) equals CP=1: log-probs and gradients; padded and packed."""
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(6))
    reference, ref_grads = ranks.run(cases.context_parallel_scores, hf_dir=tiny_models[arch], layout={}, tokens=tokens)[
        0
    ]
    for layout, packed in ((dict(cp=2), False), (dict(cp=2), True), (dict(cp=4), False), (dict(cp=4), True)):
        for logp, grads in ranks.run(
            cases.context_parallel_scores, hf_dir=tiny_models[arch], layout=layout, tokens=tokens, packed=packed
        ):
            assert (logp - reference).abs().max().item() <= 1e-5, (layout, packed)
            assert grads.keys() == ref_grads.keys()
            worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
            assert worst <= 1e-5, (layout, packed, worst)


# gpt-oss: sliding windows and sinks per packed sequence
@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM", "Qwen3NextForCausalLM"]
)
def test_packed_training_matches_padded(ranks, tiny_models, arch):
    """THD-packed micro-batches (token-balanced over DP ranks) give the padded micro-batches' loss and gradient."""
    generator = torch.Generator().manual_seed(7)
    lengths = [17, 5, 12, 9, 16, 3, 8, 14]
    tokens = torch.randint(4, 100, (8, 17), generator=generator)
    tokens[torch.arange(17)[None] >= torch.tensor(lengths)[:, None]] = 0
    for layout in _layouts(arch, [dict(tp=2), dict(pp=2)]):
        padded, packed = (
            ranks.run(
                cases.packed_vs_padded_step,
                hf_dir=tiny_models[arch],
                layout=layout,
                tokens=tokens,
                lengths=lengths,
                packed=p,
            )
            for p in (False, True)
        )
        count, loss, norm, _ = padded[0]
        for packed_count, packed_loss, packed_norm, utilization in packed:
            assert packed_loss == pytest.approx(loss, rel=1e-5) and packed_norm == pytest.approx(norm, rel=1e-5), layout
            assert packed_count == count and utilization > 0.8, (layout, packed_count, utilization)


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Qwen3NextForCausalLM"]
)
def test_packed_scoring_matches_padded(ranks, tiny_models, arch):
    """Reference/old log-probs scored in THD packs equal padded micro-batches' at every real position; under
    interleaved pipelining the packs come in a multiple of PP."""
    lengths = [17, 5, 12, 9, 16, 3, 8, 14]
    tokens = torch.randint(4, 100, (8, 17), generator=torch.Generator().manual_seed(8))
    tokens[torch.arange(17)[None] >= torch.tensor(lengths)[:, None]] = 0
    for layout in _layouts(arch, [dict(tp=2), dict(pp=2, vpp=2)]):
        for padded, packed in ranks.run(
            cases.packed_vs_padded_scores, hf_dir=tiny_models[arch], layout=layout, tokens=tokens, lengths=lengths
        ):
            assert padded.abs().sum() > 0 and (packed - padded).abs().max().item() <= 1e-5, layout


def _grouped_batch(generator: torch.Generator, groups: int, group_size: int, vocab: int) -> dict:
    """A GRPO batch: ``groups`` prompts of different lengths, each with ``group_size`` responses of 1-9 tokens."""
    prompts = [torch.randint(4, vocab, (int(n),), generator=generator) for n in torch.randint(3, 12, (groups,))]
    rows = [(p, torch.randint(4, vocab, (int(n),), generator=generator)) for p in prompts for n in
            torch.randint(1, 10, (group_size,), generator=generator)]  # fmt: skip
    width = max(len(p) + len(r) for p, r in rows)
    tokens, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width - 1)
    for i, (p, r) in enumerate(rows):
        tokens[i, : len(p) + len(r)] = torch.cat([p, r])
        mask[i, len(p) - 1 : len(p) + len(r) - 1] = 1
    return {
        "tokens": tokens,
        "lengths": torch.tensor([len(p) + len(r) for p, r in rows]),
        "prompt_lengths": torch.tensor([len(p) for p, _ in rows]),
        "mask": mask,
        "rollout_logp": torch.zeros_like(mask),
        "advantages": torch.randn(len(rows), generator=generator),
    }


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_shared_prompts_match_padded(ranks, tiny_models, arch):
    """Each prompt's samples in one row (the prompt once, a block mask, RoPE at the samples' positions, the LM head
    only where responses are predicted) give the padded rows' log-probs, losses and gradient norms over two
    optimizer steps, under data, tensor (with sequence parallelism), pipeline and expert parallelism."""
    batch = _grouped_batch(torch.Generator().manual_seed(9), groups=8, group_size=2, vocab=100)
    for layout in _layouts(arch, [dict(), dict(tp=2, sequence_parallel=True), dict(pp=2)]):
        padded, shared = (
            ranks.run(
                cases.policy_trainer_steps,
                hf_dir=tiny_models[arch],
                layout=layout,
                batch=batch,
                share_prompts=share,
                global_batch_size=8,
                micro_batch_size=2,
            )  # fmt: skip
            for share in (False, True)
        )
        for a, b in zip(padded, shared, strict=True):
            assert a["logprobs"].abs().sum() > 0 and (a["logprobs"] - b["logprobs"]).abs().max().item() <= 1e-5
            # The second step's old log-probs are those kept on the ranks before the first: its ratio moved off 1.
            assert a["kept_diff"] <= 1e-5 and b["kept_diff"] <= 1e-5 and abs(a["steps"][1]["ratio_mean"] - 1) > 1e-6
            for step_a, step_b in zip(a["steps"], b["steps"], strict=True):
                for key in ("loss", "grad_norm", "ratio_mean"):
                    assert step_b[key] == pytest.approx(step_a[key], rel=1e-5, abs=1e-7), (layout, key)
