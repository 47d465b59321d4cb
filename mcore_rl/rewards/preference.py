"""A small reward model built here: a Bradley-Terry score head on a frozen causal LM, trained on preference pairs.

The head is a linear map of the last token's hidden state (what HF's sequence classifiers score), fitted to
``P(chosen > rejected) = sigmoid(w . (h_chosen - h_rejected))`` on the LM's hidden states, which are computed once.
The result is saved as the family's one-label ``*ForSequenceClassification`` checkpoint, which
``models.reward_model`` serves. :func:`arithmetic_pairs` makes pairs from the built-in arithmetic data (the
instruction's format preferred): the reward model the benchmarks run with SmolLM2. ``python -m
mcore_rl.rewards.preference OUT [--model DIR]`` builds it.
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

import torch

from mcore_rl.data.arithmetic import arithmetic_splits

log = logging.getLogger(__name__)
Conversation = list[dict]


# Ways to answer in a sentence what the instruction asks as a number only.
VERBOSE = (
    "The answer is {answer}.",
    "Sure! Let me calculate that. The result is {answer}.",
    "{answer} is the result of this calculation. Let me know if you need anything else!",
    "Great question! After working it out step by step, I get {answer}.",
)


def arithmetic_pairs(count: int, seed: int) -> list[tuple[Conversation, Conversation]]:
    """(chosen, rejected) conversations on built-in arithmetic questions, which ask for the number only: the right
    number alone preferred to the right number in a sentence (a frozen SmolLM2's hidden states tell these apart;
    the right number from a near miss, measured, they do not: 0.53 of held-out pairs). The questions come after the
    main job's (seed ``seed``, after 2000 train and 100 eval rows), so none is trained on or evaluated later."""
    rows = arithmetic_splits(2100 + count, 0, seed)[0][2100:]
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        verbose = rng.choice(VERBOSE).format(answer=row.answer)
        pairs.append(
            tuple(row.messages + [{"role": "assistant", "content": answer}] for answer in (row.answer, verbose))
        )
    return pairs


@torch.no_grad()
def last_hidden(model, tokenizer, conversations: list[Conversation]) -> torch.Tensor:
    """The final norm's output at each conversation's last token (its chat template, no generation prompt)."""
    out = []
    for messages in conversations:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        out.append(model.model(torch.tensor([list(ids)])).last_hidden_state[0, -1])
    return torch.stack(out)


def fit_head(chosen: torch.Tensor, rejected: torch.Tensor, steps: int = 300, lr: float = 0.05) -> torch.Tensor:
    """The Bradley-Terry weight w [hidden] maximising sum log sigmoid(w . (h_chosen - h_rejected)) (full batch,
    Adam, a little weight decay so that separable pairs keep a finite w)."""
    diff = chosen - rejected
    weight = torch.zeros(diff.shape[1], requires_grad=True)
    optimizer = torch.optim.Adam([weight], lr=lr, weight_decay=1e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = -torch.nn.functional.logsigmoid(diff @ weight).mean()
        loss.backward()
        optimizer.step()
    return weight.detach()


def build_reward_model(model_dir: str, out_dir: Path, pairs, held_out: int) -> dict[str, float]:
    """Fit a score head on ``model_dir``'s hidden states of ``pairs`` (the last ``held_out`` kept out) and save the
    reward model to ``out_dir``; returns the preference accuracy on the training and the held-out pairs."""
    import transformers

    from converters.hf_io import copy_model_files, load_tokenizer
    from models.registry import get_bridge

    bridge = get_bridge(model_dir)
    if bridge.value_architecture is None:
        raise ValueError(f"{model_dir}: {bridge.architecture} has no reward-model architecture to save as")
    tokenizer = load_tokenizer(model_dir)
    causal = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    chosen = last_hidden(causal, tokenizer, [c for c, _ in pairs])
    rejected = last_hidden(causal, tokenizer, [r for _, r in pairs])
    train = slice(0, len(pairs) - held_out)
    weight = fit_head(chosen[train], rejected[train])
    correct = ((chosen - rejected) @ weight > 0).float()
    config = {k: v for k, v in causal.config.to_dict().items() if k not in ("id2label", "label2id")}
    config |= {"architectures": [bridge.value_architecture], "num_labels": 1}
    config.setdefault("pad_token_id", tokenizer.pad_token_id)
    classifier_cls = getattr(transformers, bridge.value_architecture)
    classifier = classifier_cls(type(causal.config)(**config))
    classifier.model.load_state_dict(causal.model.state_dict())
    with torch.no_grad():
        classifier.score.weight.copy_(weight[None])
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_model_files(model_dir, out_dir, skip=("config.json",))
    classifier.save_pretrained(out_dir)
    return {"train_accuracy": correct[train].mean().item(), "held_out_accuracy": correct[train.stop :].mean().item()}


def main(argv: list[str] | None = None) -> int:
    from converters.gguf2hf import default_model_dir

    parser = argparse.ArgumentParser(prog="python -m mcore_rl.rewards.preference", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory for the reward model")
    parser.add_argument("--model", default=None, help="causal LM to start from (default: the embedded SmolLM2)")
    parser.add_argument("--pairs", type=int, default=256, help="preference pairs (a quarter held out)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = args.model or str(default_model_dir())
    accuracy = build_reward_model(model, args.out, arithmetic_pairs(args.pairs, args.seed), args.pairs // 4)
    log.info("reward model in %s: preference accuracy %s", args.out, accuracy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
