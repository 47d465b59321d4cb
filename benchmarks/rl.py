"""The ``rl`` suite: end-to-end GRPO episodes of mcore-rl, its variants, and the peer (TRL's GRPOTrainer) on the
same settings, in the same run.

Each mcore-rl run is the user's command (``bash scripts/train_*.sh`` with dotted overrides), so start-up is
measured from the command to the first episode (the ``initial_sync`` event) with the venv already built. The
headline pair (mcore-rl at the main job's settings, and the peer) runs alternately, ``repeats`` times each; the
variants once each unless asked. Steady-state numbers leave out each run's first episode. Every run, the peer's
too, generates completions of the same length: the main job's 16 tokens unless ``--new-tokens`` asks for longer.

Model FLOPs are the work an episode needs, whatever the layout: 2 x parameters per token forward (x3 with the
backward), every prompt once per group, the LM head only where response tokens are predicted. Attention's score
FLOPs (under 2% at these lengths) are left out. MFU sets them against the measured matmul peak.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks.hardware import Hardware
from benchmarks.peer.venv import peer_python
from benchmarks.report import Report, min_median, pyplot, table

REPO = Path(__file__).resolve().parents[1]
PHASES = ("rollout_and_reward", "wait_for_rollout", "ref_logprobs", "old_logprobs", "train", "sync")
NEW_TOKENS = 16  # the main job's completions (scripts/configs/smollm2_135m_grpo.yaml)


@dataclass(frozen=True)
class Variant:
    name: str
    what: str
    script: str = "scripts/train_smollm2_135m_grpo.sh"
    overrides: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)


MAIN = Variant("mcore-rl", "the main job's settings (shared prompts, data parallel 2)")
VARIANTS = (
    Variant(
        "padded", "padded micro-batches (no prompt sharing)", overrides=("models.policy_trainer.share_prompts=false",)
    ),
    Variant(
        "packed",
        "THD packing, 512 tokens (no prompt sharing)",
        overrides=("models.policy_trainer.share_prompts=false", "models.policy_trainer.max_token_in_packing=512"),
    ),
    Variant("dp1", "one device: trainer and engine each on both cores", overrides=("runtime_args.num_devices=1",)),
    # The rollout modes on the same config, with the engine on a device (and core) of its own.
    Variant("split-sync", "engine on its own device, sync mode", overrides=("runtime_args.rollout_devices=1",)),
    Variant(
        "split-one-step-off",
        "engine on its own device, one_step_off mode",
        overrides=("runtime_args.rollout_devices=1", "runtime_args.rollout_mode=one_step_off"),
    ),
    Variant(
        "split-async",
        "engine on its own device, async mode (max_staleness 1, partial rollout)",
        overrides=("runtime_args.rollout_devices=1", "runtime_args.rollout_mode=async"),
    ),
    Variant(
        "moe-ep2",
        "MoE: tiny DeepSeek-V3 (MLA, 8 experts), expert parallel 2, packing",
        script="scripts/train_tiny_deepseek_v3_grpo.sh",
    ),
    Variant(
        "moe-ep1",
        "MoE: tiny DeepSeek-V3, expert parallel 1 (data parallel 2)",
        script="scripts/train_tiny_deepseek_v3_grpo.sh",
        overrides=("models.policy_trainer.parallel.ep=1",),
    ),
)


@dataclass
class Run:
    """One run's steady episodes: per-episode records (seconds per phase, samples, tokens) and its start-up."""

    name: str
    startup: float
    episodes: list[dict]
    flops_per_token: dict | None = None  # {"body": 2 x non-embedding params, "head": 2 x LM-head params}
    config: Path | None = None  # mcore-rl's resolved run config

    def median(self, key: str) -> float:
        values = [e[key] for e in self.episodes if key in e]
        return statistics.median(values) if values else 0.0

    def per_episode(self, key: str) -> list[float]:
        return [e[key] for e in self.episodes if key in e]


def flops_per_token(model_dir: str) -> dict:
    """2 x parameters per token (one forward), split into the LM head and the rest."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings().weight.numel()
    body = total - model.get_input_embeddings().weight.numel() - (0 if config.tie_word_embeddings else head)
    # MoE: only the routed experts a token goes to (top-k of the routed ones) work on it
    experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None)
    if experts:
        top_k = config.num_experts_per_tok
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        body -= routed * (1 - top_k / experts)
    return {"body": 2.0 * body, "head": 2.0 * head}


def run_mcore(variant: Variant, out: Path, episodes: int, repeat: int, new_tokens: int) -> Run:
    directory = out / "runs" / f"{variant.name}-{repeat}"
    args = [
        f"runtime_args.output_dir={directory}",
        f"runtime_args.num_episode={episodes}",
        "runtime_args.save_episode_interval=0",
        "runtime_args.eval_episode_interval=0",
        f"models.policy.rollout.train.max_new_tokens={new_tokens}",
        *variant.overrides,
    ]
    launch = time.time()
    log = out / "runs" / f"{variant.name}-{repeat}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        subprocess.run(["bash", variant.script, *args], cwd=REPO, check=True, stdout=f, stderr=subprocess.STDOUT,
                       env=os.environ | variant.env)  # fmt: skip
    return read_mcore(variant.name, directory, launch)


def read_mcore(name: str, directory: Path, launch: float) -> Run:
    """The run in ``directory`` (its metrics and resolved config), launched at ``launch``."""
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    synced = next(r["time"] for r in records if r.get("event") == "initial_sync")
    config = yaml.safe_load((directory / "config.yaml").read_text())
    rows = []
    for r in records:
        if "event" in r or r.get("episode", 0) < 2:
            continue
        rows.append(
            {
                "seconds": r["time/episode"],
                "samples": config["runtime_args"]["sample_per_episode"],
                "response_tokens": r["batch/response_tokens"],
                "tokens": r["batch/tokens"],
                "tokens_prompts_once": r["batch/tokens_prompts_once"],
                "later_fraction": 1
                - config["runtime_args"]["train_global_batch_size"] / config["runtime_args"]["sample_per_episode"],
                "trainer_rss": r.get("process/trainer_rss_bytes", 0.0),
                "engine_rss": r.get("process/engine_rss_bytes", 0.0),
                "trainer_memory": r.get("memory/trainer_bytes", 0.0),
                "object_store": r.get("throughput/object_store_bytes", 0.0),
            }
            | {phase: r.get(f"time/{phase}", 0.0) for phase in PHASES}
            | {k: v for k, v in r.items() if k.startswith("staleness/")}
        )
    flops = flops_per_token(config["models"]["policy_trainer"]["load"])
    return Run(name, synced - launch, rows, flops, directory / "config.yaml")


def run_peer(out: Path, episodes: int, repeat: int, prompts: Path, new_tokens: int) -> Run:
    directory = out / "runs" / f"trl-{repeat}"
    directory.mkdir(parents=True, exist_ok=True)
    settings = {
        "repo": str(REPO),
        "model": main_model(),
        "prompts": str(prompts),
        "prompts_per_episode": 8,
        "group_size": 4,
        "max_new_tokens": new_tokens,
        "temperature": 1.0,
        "lr": 1e-5,
        "steps_per_episode": 2,
        "episodes": episodes,
        "threads": os.cpu_count() or 1,
        "output_dir": str(directory),
        "seed": 1,
    }
    (directory / "settings.json").write_text(json.dumps(settings, indent=1))
    python = peer_python()  # built once, before the clock starts
    launch = time.time()
    with (out / "runs" / f"trl-{repeat}.log").open("w") as f:
        subprocess.run([str(python), str(REPO / "benchmarks/peer/trl_grpo.py"), str(directory / "settings.json"),
                        str(directory / "episodes.jsonl")], cwd=directory, check=True, stdout=f,
                       stderr=subprocess.STDOUT)  # fmt: skip
    records = [json.loads(line) for line in (directory / "episodes.jsonl").read_text().splitlines()]
    start = next(r["time"] for r in records if r.get("event") == "start")
    rows = [r for r in records if r.get("episode", 0) >= 2]
    return Run("TRL GRPOTrainer", start - launch, rows)


def main_model() -> str:
    from converters.gguf2hf import default_model_dir

    return str(default_model_dir())


def write_prompts(path: Path, count: int) -> Path:
    """The main job's first ``count`` training prompts in its order, for the peer."""
    from mcore_rl.config.schema import load_run_config
    from mcore_rl.data.run_data import Data

    os.environ.setdefault("MCORE_RL_MODEL", main_model())
    config = load_run_config(REPO / "scripts/configs/smollm2_135m_grpo.yaml")
    rows = [p.row for p in Data(config).train.batch(0, count)]
    path.write_text("".join(json.dumps({"messages": r.messages, "answer": r.answer}) + "\n" for r in rows))
    return path


def summary(run: Run, peak_flops: float) -> dict:
    """Steady-state medians of one run: seconds per phase, samples/s, tokens/s, model FLOP/s and MFU."""
    seconds = run.median("seconds")
    out = {
        "s/episode": seconds,
        "samples/s": run.median("samples") / seconds,
        "response tok/s": run.median("response_tokens") / seconds,
        "start-up s": run.startup,
    }
    if run.flops_per_token:
        f = run.flops_per_token
        unique, responses = run.median("tokens_prompts_once"), run.median("response_tokens")
        forward = f["body"] * unique + f["head"] * responses
        out |= {
            "trained tok/s": run.median("tokens") / seconds,
            "train s": run.median("train"),
            "train GFLOP/s": 3 * forward / run.median("train") / 1e9,
            "train MFU": 3 * forward / run.median("train") / peak_flops,
            "old logp s": run.median("old_logprobs"),
            "old logp MFU": forward * run.median("later_fraction") / max(run.median("old_logprobs"), 1e-9) / peak_flops,
            "rollout+reward s": run.median("rollout_and_reward"),
            "sync s": run.median("sync"),
            "trainer RSS GB": max(run.per_episode("trainer_rss")) / 1e9,
            "engine RSS GB": max(run.per_episode("engine_rss")) / 1e9,
            "object store MB": run.median("object_store") / 1e6,
        }
    return out


def suite(
    out: Path,
    hardware: Hardware,
    report: Report,
    episodes: int,
    repeats: int,
    variants: list[str],
    new_tokens: int = NEW_TOKENS,
) -> None:
    """``new_tokens``: the completions' length in every run (TRL's too)."""
    peak = hardware.matmul_tflops * 1e12
    prompts = write_prompts(out / "prompts.jsonl", 8 * episodes)
    ours, peers = [], []
    for repeat in range(repeats):  # A and B alternately
        ours.append(run_mcore(MAIN, out, episodes, repeat, new_tokens))
        peers.append(run_peer(out, episodes, repeat, prompts, new_tokens))
    others = [run_mcore(v, out, episodes, 0, new_tokens) for v in VARIANTS if v.name in variants]
    _headline(report, ours, peers, peak, repeats, episodes, new_tokens)
    _phases(report, [ours[0], *others], peak)
    _predicted(report, [ours[0], *(r for r in others if not r.name.startswith("split-"))], hardware)
    modes = [r for r in others if r.name.startswith("split-")]
    if modes:
        _modes(report, modes)


def _headline(
    report: Report, ours: list[Run], peers: list[Run], peak: float, repeats: int, episodes: int, new_tokens: int
) -> None:
    rows, plt = [], pyplot()
    for label, runs in (("mcore-rl", ours), ("TRL GRPOTrainer", peers)):
        per_run = [summary(r, peak) for r in runs]
        row = [label]
        for key in ("s/episode", "samples/s", "response tok/s", "start-up s"):
            lo, mid = min_median([s[key] for s in per_run])
            row.append(f"{lo:.3g} / {mid:.3g}")
        rows.append(row)
    ours_rate = statistics.median(summary(r, peak)["samples/s"] for r in ours)
    peer_rate = statistics.median(summary(r, peak)["samples/s"] for r in peers)
    fig, ax = plt.subplots(figsize=(6, 3))
    for i, runs in enumerate((ours, peers)):
        values = [v for r in runs for v in (r.median("samples") / s for s in r.per_episode("seconds"))]
        ax.scatter([i] * len(values), values, alpha=0.6)
    ax.set_xticks([0, 1], ["mcore-rl", "TRL GRPOTrainer"])
    ax.set_ylabel("samples/s (steady episodes)")
    ax.grid(alpha=0.3)
    report.add(
        "rl: mcore-rl vs TRL GRPOTrainer",
        f"SmolLM2-135M-Instruct fp32, 8 prompts x 4 samples per episode, {new_tokens} new tokens at temperature 1.0, "
        f"2 optimizer steps of 16 samples, lr 1e-5, no KL; {episodes} episodes per run (the first left out), "
        f"{repeats} runs each, alternating. Cells: min / median over runs (of each run's median episode).",
        table(["", "s/episode", "samples/s", "response tok/s", "start-up s"], rows),
        f"**mcore-rl / peer samples/s (medians): {ours_rate / peer_rate:.2f}x**",
        report.figure(fig, "rl_samples_per_s", "samples/s per steady episode"),
    )


def _phases(report: Report, runs: list[Run], peak: float) -> None:
    keys = ("s/episode", "samples/s", "trained tok/s", "response tok/s", "train s", "train GFLOP/s", "train MFU",
            "old logp s", "old logp MFU", "rollout+reward s", "sync s", "start-up s", "trainer RSS GB", "engine RSS GB",
            "object store MB")  # fmt: skip
    sums = [summary(r, peak) for r in runs]
    rows = [[r.name, *(s.get(k, "") for k in keys)] for r, s in zip(runs, sums, strict=True)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(runs)
    for phase in PHASES:
        values = [r.median(phase) for r in runs]
        ax.barh([r.name for r in runs], values, left=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("seconds per episode (median)")
    ax.legend(fontsize=7)
    what = {v.name: v.what for v in (MAIN, *VARIANTS)}
    report.add(
        "rl: phases and variants",
        "\n".join(f"- `{r.name}`: {what[r.name]}" for r in runs),
        table(["run", *keys], rows),
        report.figure(fig, "rl_phases", "seconds per phase"),
    )


# The step-time model's phases and the measured ones they predict (the rollout's includes the rewards).
PREDICTED = {"rollout": "rollout_and_reward", "old_logprobs": "old_logprobs", "train": "train", "sync": "sync"}
# The CPU's efficiencies and fixed costs (mcore_rl/planner/steptime.py's DeviceSpec) are fitted to these runs, one
# of each model, and the model is checked on the others. Each phase fits its own efficiency and fixed cost, in this
# order (the sync's probe and the rollout's prefill use the scoring's).
CALIBRATION = ("mcore-rl", "moe-ep1")
FITS = (
    ("old_logprobs", ("forward_efficiency", "call_latency")),
    ("train", ("efficiency", "tensor_update_latency")),
    ("rollout", ("memory_efficiency", "step_latency")),
    ("sync", ("copy_efficiency", "sync_latency")),
)


@dataclass(frozen=True)
class Case:
    """A run as the step-time model sees it: its config, its measured lengths, its device and its phases."""

    name: str
    config: object
    lengths: object
    device: object
    measured: dict[str, float]
    arch: object  # the model's shapes (planner.params.Architecture)
    speedup: tuple[int, float] | None = None  # a device of several cores: (cores, the trainer's speed-up on them)

    def predict(self, **fitted: float) -> dict[str, float]:
        """The phases; on a device of several cores, the trainer's at its measured speed-up, the engine's decoding
        at the device's matmul rate (it speeds up with the cores as the matmuls do: dp1's rollout took 2.09 s, the
        main job's two one-core engines 2.16, benchmarks/reports/2026-11-29_embedgemm_cpu2)."""
        from mcore_rl.planner.steptime import step_time

        device = dataclasses.replace(self.device, **fitted)
        if not self.speedup:
            return step_time(self.config, device, self.lengths, self.arch).phases
        cores, speedup = self.speedup
        trainer = dataclasses.replace(device, flops=device.flops * speedup / cores)
        phases = step_time(self.config, trainer, self.lengths, self.arch).phases
        return phases | {"rollout": step_time(self.config, device, self.lengths, self.arch).phases["rollout"]}


def _case(run: Run, hardware: Hardware) -> Case:
    from mcore_rl.config.schema import load_run_config
    from mcore_rl.planner.params import Architecture
    from mcore_rl.planner.steptime import DeviceSpec, Lengths
    from models.registry import get_bridge

    config = load_run_config(run.config)
    samples = run.median("samples")
    response = run.median("response_tokens") / samples
    lengths = Lengths(run.median("tokens") / samples - response, response,
                      config.models.policy.rollout.train.max_new_tokens)  # fmt: skip
    n = config.runtime_args.num_devices
    # each logical device has its share of the cores (and of their matmul rate and memory bandwidth; a trainer on
    # several cores, its measured speed-up on them); a pair of them exchanges over gloo at the measured rate, and
    # their data-parallel buckets through shared memory
    cores = hardware.cores // n
    speedup = (cores, core_speedup(config, lengths, cores)) if cores > 1 else None
    device = DeviceSpec.cpu(hardware.matmul_tflops * 1e12 / n, hardware.memcpy_gbps * 1e9 / n,
                            hardware.link_gbps * 1e9, hardware.cores)  # fmt: skip
    measured = {phase: run.median(m) for phase, m in PREDICTED.items()}
    arch = Architecture.from_bridge(get_bridge(config.models.policy_trainer.load))
    return Case(run.name, config, lengths, device, measured, arch, speedup)


def core_speedup(config, lengths, cores: int, repeats: int = 2) -> float:
    """How much faster the run's policy trainer takes an optimizer step on ``cores`` threads than on one: one rank in
    this process, a global batch of prompt groups at ``lengths``. A CPU device's matmuls speed up with its cores (the
    suite's matmul peak uses them all), the element-wise kernels and the Python between them much less at the main
    job's micro-batches of about a hundred positions (SmolLM2's: 1.55x on two cores, its matmuls 2x); the step-time
    model's trainer on a device of several cores runs at this speed-up over one core."""
    import torch

    from benchmarks import free_port, grpo_batch, single_process_world
    from mcore_rl.trainer.policy import PolicyTrainer

    rt, trainer = config.runtime_args, config.models.policy_trainer
    single_process_world()
    rank = PolicyTrainer(0, 1, ("127.0.0.1", free_port()), trainer, 0, 4 * repeats + 2)
    group, samples = config.models.policy.num_inference_per_prompt, rt.train_global_batch_size
    prompt, response = max(1, round(lengths.prompt)), max(1, round(lengths.response))
    batch = grpo_batch(torch.Generator().manual_seed(0), 1000, prompt, torch.full((samples,), prompt + response), group)
    threads, best = torch.get_num_threads(), {}
    try:
        for n in (cores, 1) * repeats:  # alternating; the first step of each is a warm-up
            torch.set_num_threads(n)
            for warm in (True, False):
                start = time.perf_counter()
                rank.train(batch, global_batch_size=samples, micro_batch_size=trainer.micro_batch_size)
                if not warm:
                    best[n] = min(best.get(n, float("inf")), time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[1] / best[cores]


def fit(cases: list[Case]) -> dict[str, float]:
    """The device's efficiencies and fixed costs that bring the model's phases closest to the measured ones, in
    relative terms: for each phase, its fixed cost by non-negative least squares at every efficiency of a grid, then
    of a finer grid around the best (decoding's time is the larger of its memory and compute terms, so a phase need
    not be linear in the efficiency)."""
    import numpy as np

    fitted: dict[str, float] = {}
    for phase, names in FITS:
        grid = np.geomspace(0.01, 2.0, 80)
        best = min((_fit_at(cases, fitted, phase, names, v) for v in grid), key=lambda r: r[0])[1]
        around, step = best[names[0]], grid[1] / grid[0]
        finer = np.geomspace(around / step, around * step, 41)
        fitted |= min((_fit_at(cases, fitted, phase, names, v) for v in finer), key=lambda r: r[0])[1]
    return fitted


def _fit_at(cases: list[Case], fitted: dict, phase: str, names: tuple[str, str], value: float):
    """(squared error of predicted / measured, the constants) at efficiency ``value``, with the best fixed cost."""
    import numpy as np

    efficiency, latency = names
    trial = fitted | {efficiency: float(value), latency: 0.0}
    measured = np.array([c.measured[phase] for c in cases])
    base = np.array([c.predict(**trial)[phase] for c in cases]) / measured
    unit = np.array([c.predict(**(trial | {latency: 1.0}))[phase] for c in cases]) / measured - base
    cost = max(0.0, float(unit @ (1 - base) / (unit @ unit))) if unit @ unit > 0 else 0.0
    return float(np.sum((base + cost * unit - 1) ** 2)), {efficiency: float(value), latency: cost}


def _predicted(report: Report, runs: list[Run], hardware: Hardware) -> None:
    """The planner's step-time model (mcore_rl/planner/steptime.py) for each run's config at its measured mean
    lengths, on this CPU as measured above with the efficiencies and fixed costs fitted to the calibration runs,
    against the run's median phases."""
    cases = [_case(run, hardware) for run in runs]
    calibration = [c for c in cases if c.name in CALIBRATION]
    if len(calibration) < len(CALIBRATION):
        missing = set(CALIBRATION) - {c.name for c in calibration}
        report.add("rl: the step-time model against the measured phases", f"Not fitted: no run of {missing}.")
        return
    fitted = fit(calibration)
    rows = []
    for case in cases:
        predicted = case.predict(**fitted)
        role = "fitted" if case.name in CALIBRATION else "checked"
        for phase, measured in case.measured.items():
            rows.append([case.name, role, phase, f"{predicted[phase]:.3g}", f"{measured:.3g}",
                         f"{predicted[phase] / measured:.2f}"])  # fmt: skip
    constants = ", ".join(f"{k} {v:.3g}" + (" s" if k.endswith("latency") else "") for k, v in fitted.items())
    speedups = "; ".join(f"{c.name}'s of {c.speedup[0]} cores {c.speedup[1]:.2f}x" for c in cases if c.speedup)
    report.add(
        "rl: the step-time model against the measured phases",
        "`python -m mcore_rl.planner`'s step-time model for each run's config at its measured mean lengths (the "
        "longest response: max_new_tokens), on this machine as measured above: each logical device with its share of "
        "the matmul rate and memcpy bandwidth, exchanging over gloo at the measured rate (the data-parallel buckets "
        "through shared memory, each byte copied into a window and out); a trainer on a device of several cores at "
        "the speed-up of the run's trainer step on them over one core, measured in this process (`core_speedup`: "
        f"{speedups or 'none here'}; the engine's decoding at the device's matmul rate). Its efficiencies and fixed "
        f"costs are fitted to the runs {', '.join(CALIBRATION)} (one per model; each phase its efficiency and fixed "
        f"cost, so those rows match by construction): {constants}. The other runs check the model. The rollout's "
        "measured time includes the rewards.",
        table(["run", "runs", "phase", "predicted s", "measured s", "predicted / measured"], rows),
    )


def _modes(report: Report, runs: list[Run]) -> None:
    """The rollout modes side by side: throughput, and how many policy versions the trained samples lagged."""
    lags = sorted({int(k.split("_")[1]) for r in runs for e in r.episodes for k in e if k.startswith("staleness/lag_")})
    rows = []
    for r in runs:
        seconds = r.median("seconds")
        shares = [statistics.mean(e.get(f"staleness/lag_{k}_fraction", 0.0) for e in r.episodes) for k in lags]
        rows.append(
            [r.name, f"{seconds:.3g}", f"{r.median('samples') / seconds:.3g}", f"{r.median('wait_for_rollout'):.3g}"]
            + [f"{x:.2f}" for x in shares]
            + [f"{max(r.per_episode('staleness/max'), default=0):.0f}"]
        )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    width = 0.8 / max(len(lags), 1)
    for i, k in enumerate(lags):
        values = [float(row[4 + i]) for row in rows]
        ax.bar([j + i * width for j in range(len(runs))], values, width, label=f"lag {k}")
    ax.set_xticks([j + width * (len(lags) - 1) / 2 for j in range(len(runs))], [r.name for r in runs])
    ax.set_ylabel("share of trained samples")
    ax.legend(fontsize=7)
    report.add(
        "rl: rollout modes (disaggregated: trainer on one device, engine on the other)",
        "The main job's settings with `runtime_args.rollout_devices=1`; steady episodes (the first left out). Lag: "
        "policy versions between the trainer and a sample's oldest token, as shares of the trained samples.",
        table(["run", "s/episode", "samples/s", "wait for rollout s", *(f"lag {k}" for k in lags), "max lag"], rows),
        report.figure(fig, "rl_version_lag", "version lag of the trained samples, by mode"),
    )
