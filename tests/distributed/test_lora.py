"""LoRA adapters on Megatron's tensor-parallel linears (models/lora.py): under every layout the loss, the log-probs
and the adapters' whole gradients equal one rank's; the base model is the adapters switched off; each merged
shard is the shard of ``W + scale B A`` computed from whole tensors; only the adapters train."""

from __future__ import annotations

import pytest
import torch

from converters.hf_io import HFCheckpoint
from tests.distributed import cases

LAYOUTS = [dict(tp=2), dict(tp=2, sequence_parallel=True), dict(pp=2), dict(tp=2, pp=2, sequence_parallel=True)]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_lora_step_matches_one_rank_under_every_layout(ranks, tiny_models, arch):
    tokens = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(3))
    # the model whole on every rank (data parallel only): the reference the model-parallel layouts must equal
    reference = ranks.run(cases.lora_sgd_step, hf_dir=tiny_models[arch], layout={}, tokens=tokens, rank=4)[0]
    assert reference["merge_error"] < 1e-6
    assert (reference["lora_logp"] - reference["base_logp"]).abs().max() > 1e-3  # B is not zero: the adapters act
    assert all(".lora." in n or n.startswith("lora.") for n in reference["trained"]), reference["trained"][:4]
    slots = sorted(reference["grads"])
    assert len(slots) == 4 * 4 and all(g.abs().max() > 0 for pair in reference["grads"].values() for g in pair)
    for layout in LAYOUTS:
        for got in ranks.run(cases.lora_sgd_step, hf_dir=tiny_models[arch], layout=layout, tokens=tokens, rank=4):
            assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5), layout
            assert got["merge_error"] < 1e-6, layout
            for key in ("base_logp", "lora_logp"):
                assert (got[key] - reference[key]).abs().max() < 1e-4, (layout, key)
            assert sorted(got["grads"]) == slots, layout
            for slot in slots:
                for want, have in zip(reference["grads"][slot], got["grads"][slot], strict=True):
                    assert (have - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), (layout, slot)


def test_lora_checkpoints_and_merged_exports_are_layout_free(ranks, tiny_models, tmp_path):
    """Adapters saved under TP 2 with sequence parallelism load under PP 2 and one rank alike (a gated MLP's B
    stored gate and up apart, as its weight is); the merged HF tensors exported are the same in all three, and
    differ from the base model's where adapters act."""
    hf_dir, directory = tiny_models["LlamaForCausalLM"], str(tmp_path / "ckpt")
    saved = ranks.run(
        cases.lora_checkpoint_export, hf_dir=hf_dir, layout=dict(tp=2, sequence_parallel=True), directory=directory,
        load=False,
    )[0]  # fmt: skip
    base = HFCheckpoint(hf_dir)
    changed = {n for n, t in saved.items() if not torch.equal(t, base.get(n))}
    assert any("mlp.gate_proj" in n for n in changed) and any("self_attn.o_proj" in n for n in changed)
    for layout in (dict(pp=2), dict()):
        loaded = ranks.run(cases.lora_checkpoint_export, hf_dir=hf_dir, layout=layout, directory=directory, load=True)
        assert loaded[0].keys() == saved.keys()
        for name, tensor in saved.items():
            assert (loaded[0][name] - tensor).abs().max() < 1e-6, (layout, name)
