"""An independent forward of DeepSeek-V3's multi-token-prediction layer (the technical report's definition on
HF transformers' modules), the reference of the MTP tests on CPU (tests/distributed/test_mtp.py) and on a GPU
(tests/gpu/checks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from converters.hf_io import HFCheckpoint


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_mtp_logprobs(hf_dir: str, tokens: torch.Tensor, scratch: Path) -> torch.Tensor:
    """log p_1(token i + 2) at position i ([b, s-2]) from the report's definition, on HF's modules: the main model's
    final hidden state h_i (after its norm) and the embedding of token i + 1, each RMS-normed, projected by
    ``eh_proj`` ([embedding; hidden], as the released checkpoints order them), through the MTP layer's decoder layer
    (saved in ``scratch`` as a one-layer HF DeepSeek-V3 whose final norm is ``shared_head.norm``), then the shared
    head."""
    main = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(tokens.device)
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    ckpt = HFCheckpoint(hf_dir)
    mtp = {n.removeprefix(prefix): ckpt.get(n).to(tokens.device) for n in ckpt.names() if n.startswith(prefix)}
    layer = {"model.layers.0." + n: t for n, t in mtp.items() if n.split(".")[0] in ("self_attn", "mlp")}
    layer |= {"model.layers.0." + n: mtp[n] for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    layer |= {"model.norm.weight": mtp["shared_head.norm.weight"], "lm_head.weight": mtp["shared_head.head.weight"]}
    layer |= {"model.embed_tokens.weight": mtp["embed_tokens.weight"]}
    scratch.mkdir()
    save_file(
        {n: t.contiguous().cpu() for n, t in layer.items()}, scratch / "model.safetensors", metadata={"format": "pt"}
    )
    one = dict(config, num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)
    (scratch / "config.json").write_text(json.dumps(one))
    decoder = transformers.AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32).to(tokens.device)
    eps = config["rms_norm_eps"]
    with torch.no_grad():
        hidden = main.model(tokens).last_hidden_state[:, :-1]
        embedded = main.model.embed_tokens(tokens[:, 1:])
        joined = torch.cat([_rms(embedded, mtp["enorm.weight"], eps), _rms(hidden, mtp["hnorm.weight"], eps)], -1)
        logits = decoder(inputs_embeds=joined @ mtp["eh_proj.weight"].T).logits
    logp = torch.log_softmax(logits.float(), -1)[:, :-1]
    return logp.gather(-1, tokens[:, 2:, None]).squeeze(-1)
