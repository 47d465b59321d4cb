"""A reward model served as a model (:class:`mcore_rl.trainer.value.ValueModel` on a one-label
``*ForSequenceClassification`` checkpoint): each conversation's score equals HF's sequence classifier on the same
checkpoint (fp32, within 1e-5) in padded micro-batches and THD packs, under TP 2 and PP 2."""

import pytest
import torch
import transformers

from tests.distributed import cases
from tests.tiny import make_tiny_reward_model


@pytest.fixture(scope="module")
def reward_model(tiny_models, tmp_path_factory) -> str:
    return make_tiny_reward_model(tiny_models["LlamaForCausalLM"], tmp_path_factory.mktemp("rm"))


def test_reward_model_scores_match_hf(ranks, reward_model):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 10, 5, 12, 9, 3, 8])
    tokens = torch.randint(4, 100, (8, 12), generator=generator)
    tokens[torch.arange(12)[None] >= lengths[:, None]] = 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model)
    with torch.no_grad():  # one row at a time: the tiny config has no pad token for HF's pooling
        want = torch.cat([hf(tokens[i : i + 1, : int(n)]).logits[:, 0] for i, n in enumerate(lengths)])
    assert want.std() > 1e-3
    for rows in (1, 3):  # fewer rows than the 4 data-parallel ranks, or not a multiple: one group's samples
        for got in ranks.run(
            cases.reward_model_scores, hf_dir=reward_model, layout={}, tokens=tokens[:rows], lengths=lengths[:rows]
        ):
            assert got.shape == (rows,) and (got - want[:rows]).abs().max().item() < 1e-5, rows
    for layout in (dict(tp=2), dict(pp=2), dict(tp=2, sequence_parallel=True)):
        for packing in (0, 32):
            for got in ranks.run(
                cases.reward_model_scores, hf_dir=reward_model, layout=layout, tokens=tokens, lengths=lengths,
                packing=packing,
            ):  # fmt: skip
                assert (got - want).abs().max().item() < 1e-5, (layout, packing, got, want)


def test_smollm2_reward_model_scores_its_conversations_as_hf(ranks3, tmp_path):
    """The real model's shape (tied embeddings, unpadded 49152-row vocabulary, 9 / 3 heads under TP 3): a SmolLM2
    reward model built by ``mcore_rl.rewards.preference`` scores conversations rendered with its chat template as
    HF's classifier does, padded and packed; and it prefers the format it was fitted to."""
    from converters.gguf2hf import default_model_dir
    from mcore_rl.rewards.model import conversation_tokens
    from mcore_rl.rewards.preference import arithmetic_pairs, build_reward_model

    pairs = arithmetic_pairs(24, seed=1)
    accuracy = build_reward_model(str(default_model_dir()), tmp_path / "rm", pairs, held_out=8)
    assert accuracy["held_out_accuracy"] >= 0.75, accuracy
    conversations = [c for pair in pairs[-4:] for c in pair]  # held out: chosen, rejected, ...
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "rm")
    batch = conversation_tokens(tokenizer, conversations)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    with torch.no_grad():
        want = torch.cat(
            [hf(batch["tokens"][i : i + 1, : int(n)]).logits[:, 0] for i, n in enumerate(batch["lengths"])]
        )
    assert (want[0::2] > want[1::2]).float().mean() >= 0.75  # the number alone beats the sentence
    for packing in (0, 128):
        for got in ranks3.run(
            cases.reward_model_scores, hf_dir=str(tmp_path / "rm"), layout=dict(tp=3), tokens=batch["tokens"],
            lengths=batch["lengths"], packing=packing,
        ):  # fmt: skip
            # fp32 within 1e-5 of the scores' scale (the fitted head scores about +-25; TP sums in another order)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), (packing, got, want)
