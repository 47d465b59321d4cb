"""The ``experts`` suite: routed experts as grouped GEMMs (:meth:`models.experts.GroupedExperts.grouped_forward`)
against Megatron's ``SequentialMLP`` (a loop of two GEMMs per expert), and the path the device chooses for that
many experts (:meth:`parallel.device.Device.grouped_experts`), forward + backward rows/s over expert counts and
token skew. All run on the same module (the same weights), on one rank: a Qwen3-MoE-shaped expert layer (hidden
512, expert FFN 256, gated SiLU) in the machine's parameter dtype.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from benchmarks import single_process_world
from benchmarks.report import Report, pyplot, table

EXPERTS = (2, 8, 32, 128, 256)
ROWS = 4096  # token-expert assignments per call (tokens x top-k)
SKEWS = {"uniform": 0.0, "zipf 1": 1.0, "zipf 2": 2.0}  # expert i's share ~ 1 / (i+1)^s


def counts(experts: int, skew: float, generator: torch.Generator) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
    picks = torch.multinomial(weights / weights.sum(), ROWS, replacement=True, generator=generator)
    return torch.bincount(picks, minlength=experts)


def _experts_module(experts: int, scratch: Path):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from converters.stream import load_weights
    from models.registry import get_bridge
    from parallel.config import ParallelConfig
    from parallel.groups import init_parallel
    from tests.tiny import make_tiny

    hf_dir = make_tiny(
        "Qwen3MoeForCausalLM", scratch / f"e{experts}", hidden_size=512, moe_intermediate_size=256,
        num_experts=experts, num_experts_per_tok=min(8, experts), num_hidden_layers=1,
    )  # fmt: skip
    parallel = ParallelConfig()
    groups = init_parallel(parallel)
    bridge = get_bridge(hf_dir)
    chunks = bridge.build_model(bridge.transformer_config(parallel, moe_grouped_gemm=True))
    load_weights(chunks, bridge, hf_dir, groups)
    return next(m for m in chunks[0].modules() if isinstance(m, SequentialMLP))


def _rows_per_s(forwards, module, hidden, token_counts, probs, rounds: int = 5) -> list[float]:
    """Rows/s of each forward + backward, the best of ``rounds`` after a warm-up round; the paths take turns in
    every round, so that a host that slows down for a while slows them all rather than one."""
    best = [float("inf")] * len(forwards)
    for round_ in range(rounds + 1):
        for i, forward in enumerate(forwards):
            x = hidden.clone().requires_grad_()
            start = time.perf_counter()
            out, _ = forward(module, x, token_counts, probs)
            out.backward(torch.ones_like(out))
            if round_:
                best[i] = min(best[i], time.perf_counter() - start)
    return [ROWS / seconds for seconds in best]


def suite(out: Path, hardware, report: Report) -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP

    from models.experts import GroupedExperts

    single_process_world()
    generator = torch.Generator().manual_seed(0)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        for experts in EXPERTS:
            module = _experts_module(experts, Path(scratch))
            weight = next(module.parameters())
            hidden = torch.randn(ROWS, module.config.hidden_size, generator=generator).to(weight)
            probs = torch.rand(ROWS, generator=generator).to(weight)
            chosen = "grouped" if module.grouped_kernel else "loop"
            for skew_name, skew in SKEWS.items():
                c = counts(experts, skew, generator)
                paths = (GroupedExperts.grouped_forward, SequentialMLP.forward, GroupedExperts.forward)
                grouped, sequential, picked = _rows_per_s(paths, module, hidden, c, probs)
                results[(experts, skew_name)] = picked / sequential
                rows.append([experts, skew_name, int(c.max()), int((c == 0).sum()), grouped, sequential, chosen,
                             picked, f"{grouped / sequential:.2f}x", f"{picked / sequential:.2f}x"])  # fmt: skip
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    for skew_name in SKEWS:
        ax.plot(EXPERTS, [results[(e, skew_name)] for e in EXPERTS], marker="o", label=skew_name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("experts")
    ax.set_ylabel("chosen path / loop rows/s")
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.legend()
    report.add(
        "experts: grouped vs sequential, and the path chosen",
        f"{ROWS} token-expert rows per forward + backward, hidden 512, expert FFN 256; best of 5 rounds in which "
        "the three take turns. Chosen: the path `parallel.device.Device.grouped_experts` takes on this device for "
        "that many local experts.",
        table(
            [
                "experts",
                "skew",
                "busiest expert rows",
                "idle experts",
                "grouped rows/s",
                "loop rows/s",
                "chosen",
                "chosen rows/s",
                "grouped / loop",
                "chosen / loop",
            ],
            rows,
        ),  # fmt: skip
        report.figure(fig, "experts_speedup", "chosen path / loop"),
    )
