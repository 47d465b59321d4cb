"""DeepSeek-V3's multi-token prediction (models/mtp.py): the MTP layer of a tiny DeepSeek-V3 checkpoint converts both
ways bit-exact; Megatron's MTP block gives, under every layout, the single rank's log-probs and those of an
independent forward written from the DeepSeek-V3 report; the MTP loss trains the same under every layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.hf_io import HFCheckpoint
from tests.distributed import cases
from tests.distributed.test_converters import assert_same_tensors, cli, hf_tensors, ok
from tests.mtp_reference import reference_mtp_logprobs

ARCH = "DeepseekV3ForCausalLM"
LAYOUTS = [
    dict(tp=2, sequence_parallel=True),
    dict(pp=2),
    dict(ep=2),
    dict(tp=2, ep=2, sequence_parallel=True),
    dict(cp=2),
]


def _batch():
    generator = torch.Generator().manual_seed(4)
    lengths = [12, 9, 7, 12]
    tokens = torch.randint(4, 100, (4, 12), generator=generator)
    for row, n in enumerate(lengths):
        tokens[row, n:] = 0
    return tokens, lengths


def test_mtp_log_probs_match_the_report_s_definition_and_the_single_rank_under_every_layout(
    ranks, tiny_models, tmp_path
):
    """The MTP block's depth-1 log-probs equal the independent forward (fp32, 1e-5) on a single rank, for padded
    and packed micro-batches, and under TP with sequence parallelism, PP, EP, TP x EP and CP; running the block
    leaves the model's own log-probs as they are without it."""
    hf_dir = tiny_models[ARCH]
    tokens, lengths = _batch()
    expected = reference_mtp_logprobs(hf_dir, tokens, tmp_path / "mtp_layer")
    valid = torch.arange(10)[None] < torch.tensor(lengths)[:, None] - 2  # positions whose token i + 2 is real
    for layout in [{}, *LAYOUTS]:
        for packing in (0, 24):
            mtp, main, plain = ranks.run(
                cases.mtp_scores, hf_dir=hf_dir, layout=layout, tokens=tokens, lengths=lengths, packing=packing
            )[0]
            gap = ((mtp[:, :10] - expected).abs() * valid).max().item()
            assert gap < 1e-5, (layout, packing, gap)
            real = torch.arange(11)[None] < torch.tensor(lengths)[:, None] - 1
            assert (((main - plain).abs()) * real).max().item() < 1e-6, (layout, packing)


def test_the_mtp_loss_trains_alike_under_every_layout(ranks, tiny_models, tmp_path):
    """Two GRPO episodes with ``mtp_loss_coef``: the MTP loss, the total loss and the gradient norm of every step,
    and the second episode's log-probs (after updates the MTP loss shaped through the shared embedding and the
    trunk), equal the single rank's under TP with SP, PP, EP and TP x EP, padded and packed; the loss is the
    independent forward's on the step's response tokens, and the coefficient moves the gradient."""
    hf_dir = tiny_models[ARCH]
    run = lambda layout, packing=0, coef=0.5: ranks.run(  # noqa: E731
        cases.policy_trainer_episodes, hf_dir=hf_dir, layout=layout, max_token_in_packing=packing, mtp_loss_coef=coef
    )[0]
    reference = run({})
    without = run({}, coef=0.0)
    assert "mtp/loss" not in without["steps"][0]
    assert reference["steps"][0]["grad_norm"] != pytest.approx(without["steps"][0]["grad_norm"], rel=1e-4)

    # the first step's MTP loss, independently: rows 0-3, response tokens (mask[i + 1]) over their count
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 9, 7, 12, 10, 8, 11, 6])
    tokens = torch.randint(4, 100, (8, 12), generator=generator)
    tokens[torch.arange(12)[None] >= lengths[:, None]] = 0
    mask = ((torch.arange(11)[None] >= 4) & (torch.arange(11)[None] < lengths[:, None] - 1)).float()[:4]
    logp = reference_mtp_logprobs(hf_dir, tokens[:4], tmp_path / "mtp_layer")
    expected = -(logp * mask[:, 1:]).sum() / mask.sum()
    assert reference["steps"][0]["mtp/loss"] == pytest.approx(expected.item(), rel=1e-5)

    for layout in LAYOUTS[:4]:
        for packing in (0, 24):
            result = run(layout, packing)
            for step, want in zip(result["steps"], reference["steps"], strict=True):
                for key in ("mtp/loss", "loss", "grad_norm"):
                    assert step[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (layout, packing, key)
            assert (result["logprobs"][1] - reference["logprobs"][1]).abs().max().item() <= 1e-5, (layout, packing)


def test_an_mtp_checkpoint_converts_both_ways_bit_exact_and_copies_that_differ_are_refused(tiny_models, tmp_path):
    """hf2mcore -> mcore2hf keeps the MTP layer (its norms, projection, decoder layer, and its copies of the
    embedding and the head) bit-exact; a checkpoint whose MTP copy of the embedding differs from the model's is
    refused by name (Megatron's MTP shares one embedding)."""
    source = Path(tiny_models[ARCH])
    names = [n for n in HFCheckpoint(source).names() if n.startswith("model.layers.4.")]
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.shared_head.head.weight"} <= set(names)
    assert any(".mlp.experts." in n for n in names)
    ok(cli("hf2mcore", source, tmp_path / "mcore"))
    ok(cli("mcore2hf", tmp_path / "mcore", tmp_path / "hf"))
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(source))

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    (file,) = source.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.4.embed_tokens.weight"] = tensors["model.layers.4.embed_tokens.weight"] + 1
    save_file(tensors, broken / file.name, metadata={"format": "pt"})
    run = cli("hf2mcore", broken, tmp_path / "never")
    assert run.returncode != 0
    assert "model.layers.4.embed_tokens.weight" in run.stderr and "differ from model.embed_tokens.weight" in run.stderr
    assert not (tmp_path / "never").exists()
    assert json.loads((source / "config.json").read_text())["num_nextn_predict_layers"] == 1
