"""Every per-token quantity the policy trainer logs or optimises, against HF transformers on the same batch.

The trainer side is the real role (:class:`mcore_rl.trainer.policy.PolicyTrainer`): its old log-probs, and the
metrics and gradient norm of one GRPO step with KL and entropy terms. The reference is written here from HF's
full-vocabulary logits, in float64, without the project's GRPO functions. Vocabularies that Megatron pads and
that it does not (SmolLM2's 49152 rows: fp32 logits there reach the loss without a copy), TP 1 and 2, fp32 and
bf16 logits. The tiny models are initialised wide (std 0.3) so that their next-token distributions are far from
uniform: an entropy computed from the wrong tensor then shows.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from converters.gguf2hf import default_model_dir
from tests.distributed import cases
from tests.tiny import make_tiny

LOSS = dict(kl_coef=0.1, entropy_coef=0.01, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
# params dtype -> tolerances: per-token log-prob, batch-mean metrics (abs), gradient norm (rel). In bf16 both sides
# round (differently): measured on the wide tiny model, log-probs differ by up to 0.45, the clip fraction by 3 of
# 48 tokens, the gradient norm by 8%; an entropy of the wrong tensor is off by about 3.
TOLERANCE = {"float32": (1e-4, 1e-5, 1e-4), "bfloat16": (0.6, 0.1, 0.15)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("reference")
    wide = dict(initializer_range=0.3)
    return {
        "unpadded": str(make_tiny("LlamaForCausalLM", root / "v256", vocab_size=256, **wide)),  # 2 x 128: no padding
        "padded": str(make_tiny("LlamaForCausalLM", root / "v100", vocab_size=100, **wide)),
        "smollm2": str(default_model_dir()),
    }


def _batch(hf_dir: str, prompts: list[list[int]], new_tokens: int, seed: int) -> dict:
    """Responses sampled from the HF model (temperature 1), right-padded as the driver's training batch is, with
    old/rollout/reference log-probs and advantages that make ratios, clipping, KL and TIS weights non-trivial."""
    model = _hf_model(hf_dir, torch.float32)
    torch.manual_seed(seed)
    sequences = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=True, top_k=0)
        sequences.append((prompt, out[0, len(prompt) :].tolist()))
    length = max(len(p) + len(r) for p, r in sequences)
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length - 1)
    for i, (prompt, response) in enumerate(sequences):
        tokens[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        mask[i, len(prompt) - 1 : len(prompt) - 1 + len(response)] = 1
    with torch.no_grad():
        logp = _hf_tokens(model, tokens)[0].float()
    generator = torch.Generator().manual_seed(seed)

    def near(spread: float) -> torch.Tensor:
        return (logp + spread * torch.randn(logp.shape, generator=generator)) * mask

    old = near(0.2)
    return {
        "tokens": tokens,
        "lengths": torch.tensor([len(p) + len(r) for p, r in sequences]),
        "prompt_lengths": torch.tensor([len(p) for p, _ in sequences]),
        "mask": mask,
        "old_logp": old,
        "rollout_logp": (old + 0.1 * torch.randn(old.shape, generator=generator)) * mask,
        "ref_logp": near(0.3),
        "advantages": torch.randn(len(sequences), generator=generator),
    }


def _hf_model(hf_dir: str, dtype: torch.dtype):
    """HF's model, differentiated as the trainer differentiates it: without ``padding_idx``. SmolLM2's config.json
    makes ``<|im_end|>`` (id 2, which ends every chat turn) its pad token, and HF's embedding then drops that row's
    input gradient; Megatron's (and the loss's exact) gradient keeps it (measured: that row alone off by 170%)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    model.get_input_embeddings().padding_idx = None
    return model


def _hf_tokens(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's per-token log p(next token) and entropy [N, L-1], in float64 from the model's logits."""
    log_softmax = model(tokens[:, :-1]).logits.double().log_softmax(-1)
    logp = log_softmax.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return logp, entropy


def _hf_step(hf_dir: str, batch: dict, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, float]]:
    """HF's log-probs and the GRPO step's token-mean metrics and gradient norm, written out from the definitions."""
    model = _hf_model(hf_dir, dtype)
    logp, entropy = _hf_tokens(model, batch["tokens"])
    mask = batch["mask"].double()
    old, rollout, ref = (batch[k].double() for k in ("old_logp", "rollout_logp", "ref_logp"))
    adv = batch["advantages"].double()
    adv = adv[:, None] if adv.dim() == 1 else adv  # per sample, or per token (REINFORCE++, GAE, distillation)

    def mean(x):
        return (x * mask).sum() / mask.sum()

    ratio = torch.exp(logp - old)
    low, high = 1 - LOSS["clip_low"], 1 + LOSS["clip_high"]
    binds = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))  # the clip takes the gradient away
    surrogate = -adv * torch.where(binds, ratio.clamp(low, high), ratio)
    weight = torch.exp(old - rollout).clamp(max=LOSS["tis_cap"])
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    loss = mean(surrogate * weight) + LOSS["kl_coef"] * mean(kl) - LOSS["entropy_coef"] * mean(entropy)
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))
    metrics = {
        "entropy": mean(entropy),
        "kl": mean(kl),
        "ratio_mean": mean(ratio),
        "clip_fraction": mean(binds.double()),
        "tis_weight_mean": mean(weight),
        "rollout_logp_abs_diff": mean((old - rollout).abs()),
        "policy_loss": loss,
        "loss": loss,
        "grad_norm": grad_norm,
    }
    return logp.detach(), {k: v.item() for k, v in metrics.items()}


def _check(pool, hf_dir: str, batch: dict, params_dtype: str, variants: list[tuple[dict, bool, int]]) -> dict:
    """The trainer's first step on ``batch`` against HF's (computed once), for each ``(layout, share_prompts,
    packing)`` variant; HF's metrics."""
    token_tol, metric_tol, grad_tol = TOLERANCE[params_dtype]
    logp, expected = _hf_step(hf_dir, batch, getattr(torch, params_dtype))
    for layout, share_prompts, packing in variants:
        real = torch.arange(batch["tokens"].shape[1] - 1)[None] < batch["lengths"][:, None] - 1
        if share_prompts:  # shared-prompt rows score response positions only
            assert batch["mask"].sum() < real.sum()
            real = batch["mask"].bool()
        for result in pool.run(
            cases.policy_trainer_first_step,
            hf_dir=hf_dir,
            layout=layout,
            batch=batch,
            loss=LOSS,
            params_dtype=params_dtype,
            share_prompts=share_prompts,
            max_token_in_packing=packing,
        ):
            diff = (result["logprobs"].double() - logp).abs()[real]
            assert diff.max().item() <= token_tol, (layout, params_dtype, diff.max().item())
            step = result["step"]
            for key, value in expected.items():
                if key == "grad_norm":
                    assert step[key] == pytest.approx(value, rel=grad_tol), (layout, params_dtype, key)
                else:
                    assert step[key] == pytest.approx(value, abs=metric_tol), (layout, params_dtype, key)
    return expected


PROMPTS = [[5, 17, 40, 9], [12, 7, 7, 33, 21, 3], [50, 60], [8, 19, 27]]  # token ids below every tiny vocabulary


@pytest.mark.parametrize(
    "model, params_dtype",
    [("unpadded", "float32"), ("padded", "float32"), ("unpadded", "bfloat16")],
)
def test_tiny_trainer_quantities_match_hf(ranks, models, model, params_dtype):
    batch = _batch(models[model], PROMPTS, new_tokens=12, seed=0)
    vocab = transformers.AutoConfig.from_pretrained(models[model]).vocab_size
    expected = _check(ranks, models[model], batch, params_dtype, [(dict(tp=tp), False, 0) for tp in (1, 2)])
    # The wide initialisation makes the distributions peaked: an entropy of the wrong tensor is near ln V.
    assert expected["entropy"] < 0.6 * torch.log(torch.tensor(float(vocab))).item()


def test_smollm2_trainer_quantities_match_hf(ranks, models):
    """The real model: unpadded 49152-row vocabulary, tied embeddings, 9 query / 3 KV heads, sampled responses; in
    padded rows and in shared-prompt rows (each prompt sampled twice, as GRPO groups are)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(models["smollm2"])
    questions = [
        q for q in ("What is 12 + 30?", "Name a primary colour.", "Finish: the fox", "What is 7 x 6?") for _ in "ab"
    ]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]
    batch = _batch(models["smollm2"], prompts, new_tokens=16, seed=0)
    expected = _check(ranks, models["smollm2"], batch, "float32", [(dict(tp=1), False, 0), (dict(tp=1), True, 0)])
    assert 0.5 < expected["entropy"] < 5  # about 2 nats per response token; ln(49152) = 10.8


def test_per_token_advantages_match_hf_in_padded_packed_and_shared_prompt_rows(ranks, models):
    """Per-token advantages (REINFORCE++, GAE, distillation) reach every response token of the loss: padded rows,
    THD packs and shared-prompt rows (each prompt sampled twice) all give HF's loss, metrics and gradient norm."""
    batch = _batch(models["padded"], [p for p in PROMPTS for _ in "ab"], new_tokens=12, seed=1)
    generator = torch.Generator().manual_seed(1)
    batch["advantages"] = torch.randn(batch["mask"].shape, generator=generator) * batch["mask"]
    _check(
        ranks,
        models["padded"],
        batch,
        "float32",
        [(dict(tp=2), False, 0), (dict(tp=2), False, 64), (dict(tp=2), True, 0)],
    )
