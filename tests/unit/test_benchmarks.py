"""The benchmark suite's own arithmetic: the machine probes return rates, model FLOPs count the right parameters,
the rl summary divides what it says, the report writes its sections. (Timings themselves are never asserted.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from benchmarks import agent, experts, hardware, lm_head, packing, rl, steptime
from benchmarks.report import Report, pyplot, table
from converters.gguf2hf import default_model_dir


def test_probes_measure_positive_rates(tmp_path):
    assert hardware.matmul_tflops(torch.device("cpu"), torch.float32, sizes=(64,), repeats=1) > 0
    assert hardware.memcpy_gbps(torch.device("cpu"), nbytes=8 << 20, repeats=1) > 0
    write, read = hardware.disk_gbps(tmp_path, nbytes=64 << 20)
    assert write > 0 and read > 0 and not list(tmp_path.iterdir())  # the probe file is gone
    assert hardware.versions()["torch"] == torch.__version__


def test_model_flops_split_lm_head_from_the_body():
    """SmolLM2-135M: 134,515,008 parameters, of which the tied 49152 x 576 embedding is the LM head."""
    flops = rl.flops_per_token(str(default_model_dir()))
    assert flops == {"head": 2.0 * 49152 * 576, "body": 2.0 * (134_515_008 - 49152 * 576)}


def test_rl_summary_divides_what_it_says():
    run = rl.Run(
        "x",
        startup=30.0,
        episodes=[
            {
                "seconds": 10.0,
                "samples": 32,
                "response_tokens": 320.0,
                "tokens": 1920.0,
                "tokens_prompts_once": 680.0,
                "later_fraction": 0.5,
                "train": 5.0,
                "old_logprobs": 1.0,
                "rollout_and_reward": 2.0,
                "sync": 2.0,
                "trainer_rss": 2e9,
                "engine_rss": 1e9,
            }  # fmt: skip
        ],
        flops_per_token={"body": 2.0, "head": 1.0},
    )
    s = rl.summary(run, peak_flops=100.0)
    forward = 2.0 * 680 + 1.0 * 320
    assert s["samples/s"] == 3.2 and s["response tok/s"] == 32.0 and s["trained tok/s"] == 192.0
    assert s["train MFU"] == pytest.approx(3 * forward / 5.0 / 100.0)
    assert s["old logp MFU"] == pytest.approx(forward * 0.5 / 1.0 / 100.0)
    assert s["start-up s"] == 30.0 and s["trainer RSS GB"] == 2.0


def test_packing_and_experts_inputs():
    assert packing.padded_utilization([4, 2, 3, 3], micro_batch_size=2) == pytest.approx(12 / 14)
    c = experts.counts(16, 2.0, torch.Generator().manual_seed(0))
    assert c.sum() == experts.ROWS and c[0] == c.max()  # zipf: the first expert is the busiest
    batch = packing.long_tailed_batch(torch.Generator().manual_seed(0), vocab=100)
    assert (
        batch["tokens"][:: packing.GROUP, : packing.PROMPT_TOKENS]
        == batch["tokens"][1 :: packing.GROUP, : packing.PROMPT_TOKENS]
    ).all()
    assert batch["mask"].sum() == (batch["lengths"] - packing.PROMPT_TOKENS).sum()


def test_lm_head_measures_both_losses_in_processes_of_their_own():
    """Each mode's peak comes from its own process (no allocator state shared), and the unchunked loss, whose fp32
    softmax spans the micro-batch, peaks above the chunked one once the micro-batch exceeds a chunk."""
    spec = dict(tokens=2048, vocab=8192, hidden=64, entropy_bonus=True, chunk_bytes=4 << 20)
    before, after = (lm_head._measure(spec | {"mode": mode}) for mode in ("before", "after"))
    assert isinstance(before, dict) and isinstance(after, dict), (before, after)
    # fp32 on CPU; after: the logits, their gradient and a few 4 MiB chunks, measured as the process's peak resident
    # set, which also holds what the allocator keeps (a CI run measured 3.1 x logits once)
    logits = 2048 * 8192 * 4
    assert before["peak_bytes"] > 4 * logits and logits < after["peak_bytes"] < 3.5 * logits, (before, after)


def test_report_writes_sections_and_figures(tmp_path):
    report = Report(tmp_path)
    plt = pyplot()
    fig, _ = plt.subplots()
    report.add("suite", table(["a", "b"], [[1, 0.12345], ["x", 12345.6]]), report.figure(fig, "plot", "a plot"))
    text = report.write("# header").read_text()
    assert "| 1 | 0.123 |" in text and "| x | 12346 |" in text and "![a plot](plot.png)" in text
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_cli_names_the_suites(capsys):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "rl" in capsys.readouterr().out


def test_agent_cold_start_examples_are_trajectories_of_unseen_problems():
    """The tool run's examples: prompt, a calculator call with the problem's expression, the result (masked), the
    answer; the direct run's: prompt, answer. Their problems are none of the runs' train or eval problems."""
    import transformers

    from mcore_rl.data.arithmetic import word_problem_splits

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    tool, direct = agent.cold_start_examples(tokenizer, True, 2), agent.cold_start_examples(tokenizer, False, 2)
    rows = word_problem_splits(2066, 0, seed=1)[0][2064:]
    for (ids, mask), (direct_ids, direct_mask), row in zip(tool, direct, rows, strict=True):
        trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        call = json.dumps({"name": "calculator", "arguments": {"expression": row.extra["expression"]}})
        assert trained == f"<tool_call>\n{call}\n</tool_call><|im_end|>{row.answer}<|im_end|>"
        assert tokenizer.decode(ids).endswith(
            f"<|im_start|>tool\n{row.answer}<|im_end|>\n<|im_start|>assistant\n{row.answer}<|im_end|>"
        )
        assert (
            tokenizer.decode([t for t, m in zip(direct_ids, direct_mask, strict=True) if m])
            == f"{row.answer}<|im_end|>"
        )
    seen = {r.messages[0]["content"] for split in word_problem_splits(2000, 64, seed=1) for r in split}
    assert not seen & {r.messages[0]["content"] for r in rows}


def test_the_step_time_suite_predicts_each_published_run_on_its_terms():
    """Each published row's layout is a valid run config, and the prediction counts tokens as the peer does."""
    for row in steptime.PUBLISHED:
        t = steptime.predict(row)
        assert t.devices == row.gpus and t.tokens == pytest.approx(row.samples * row.mean_seq)
        assert t.tokens_per_device_second == pytest.approx(t.tokens / t.seconds / row.gpus)
        assert t.phases["rollout"] > 0 and t.phases["train"] > 0 and t.phases["sync"] > 0


def test_the_rl_suite_fit_recovers_the_device_its_phases_were_made_with(monkeypatch, tmp_path):
    """Phases predicted with known CPU efficiencies and fixed costs for the suite's two calibration runs (SmolLM2's
    main job, the tiny DeepSeek-V3 at EP 1): the fit finds those constants again, and they reproduce every phase."""
    from mcore_rl.config.schema import load_run_config
    from mcore_rl.planner.params import Architecture
    from mcore_rl.planner.steptime import DeviceSpec, Lengths
    from models.registry import get_bridge
    from tests.tiny import make_tiny

    truth = dict(forward_efficiency=0.6, call_latency=0.1, efficiency=0.35, tensor_update_latency=0.001,
                 memory_efficiency=0.3, step_latency=0.02, copy_efficiency=0.12, sync_latency=0.05)  # fmt: skip
    device = DeviceSpec.cpu(0.09e12, 8e9, 1.5e9, 2)
    tiny = make_tiny("DeepseekV3ForCausalLM", tmp_path / "tiny")
    cases = []
    for name, config, model, overrides in (
        ("mcore-rl", "smollm2_135m_grpo", default_model_dir(), []),
        ("moe-ep1", "tiny_deepseek_v3_grpo", tiny, ["models.policy_trainer.parallel.ep=1"]),
    ):
        monkeypatch.setenv("MCORE_RL_MODEL", str(model))
        config = load_run_config(rl.REPO / f"scripts/configs/{config}.yaml", overrides)
        case = rl.Case(name, config, Lengths(45, 15, 16), device, {}, Architecture.from_bridge(get_bridge(str(model))))
        cases.append(dataclasses.replace(case, measured={p: case.predict(**truth)[p] for p in rl.PREDICTED}))
    fitted = rl.fit(cases)
    assert fitted.keys() == truth.keys()
    assert all(fitted[k] == pytest.approx(v, rel=0.01) for k, v in truth.items())
    for case in cases:
        predicted = case.predict(**fitted)
        assert all(predicted[p] == pytest.approx(case.measured[p], rel=0.005) for p in rl.PREDICTED)


def test_a_trainer_on_several_cores_runs_at_its_measured_speed_up_and_the_engine_at_the_matmul_rate(monkeypatch):
    """The dp1 run's device holds both cores: its trainer's phases are those of a device whose matmul rate is one
    core's times the measured speed-up, its engine's decoding that of the whole device."""
    from mcore_rl.config.schema import load_run_config
    from mcore_rl.planner.params import Architecture
    from mcore_rl.planner.steptime import DeviceSpec, Lengths, step_time
    from models.registry import get_bridge

    monkeypatch.setenv("MCORE_RL_MODEL", str(default_model_dir()))
    config = load_run_config(rl.REPO / "scripts/configs/smollm2_135m_grpo.yaml", ["runtime_args.num_devices=1"])
    arch, lengths = Architecture.from_bridge(get_bridge(str(default_model_dir()))), Lengths(45, 15, 16)
    fitted = dict(forward_efficiency=0.7, efficiency=0.8, memory_efficiency=0.5, copy_efficiency=0.2)
    device = DeviceSpec.cpu(0.18e12, 16e9, 3e9, 2)
    case = rl.Case("dp1", config, lengths, device, {}, arch, speedup=(2, 1.25))
    predicted = case.predict(**fitted)
    whole = step_time(config, dataclasses.replace(device, **fitted), lengths, arch).phases
    one_core = step_time(config, dataclasses.replace(device, **fitted, flops=0.09e12 * 1.25), lengths, arch).phases
    assert predicted["rollout"] == pytest.approx(whole["rollout"])
    for phase in ("old_logprobs", "train", "sync"):
        assert predicted[phase] == pytest.approx(one_core[phase]) and predicted[phase] > whole[phase], phase


def test_the_completion_length_reaches_every_run_and_the_peer(monkeypatch, tmp_path):
    """``--new-tokens``: mcore-rl's runs and TRL's generate completions of the same length."""

    class LaunchedError(Exception):
        pass

    commands = []

    def launch(command, **kwargs):
        commands.append(command)
        raise LaunchedError

    monkeypatch.setattr(rl.subprocess, "run", launch)
    monkeypatch.setattr(rl, "peer_python", lambda: Path("python"))
    with pytest.raises(LaunchedError):
        rl.run_mcore(rl.MAIN, tmp_path, episodes=4, repeat=0, new_tokens=64)
    with pytest.raises(LaunchedError):
        rl.run_peer(tmp_path, episodes=4, repeat=0, prompts=tmp_path / "prompts.jsonl", new_tokens=64)
    assert "models.policy.rollout.train.max_new_tokens=64" in commands[0]
    assert json.loads((tmp_path / "runs" / "trl-0" / "settings.json").read_text())["max_new_tokens"] == 64
