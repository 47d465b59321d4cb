"""Full-size dry runs on meta tensors: every train script's ``--dry-run`` (its config's layout, the whole HF <->
Megatron mapping and the rollout-sync plan, checked against transformers' own model of the public config.json).
Runs happen in subprocesses (fake process groups of each config's device count); the train scripts' share one."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = [
    ("qwen3_8b_grpo", "qwen3_8b", []),
    ("qwen3_30b_a3b_gspo", "qwen3_30b_a3b", []),
    ("moonlight_16b_a3b_grpo", "moonlight_16b_a3b", []),
    ("qwen3_235b_a22b_grpo", "qwen3_235b_a22b", [pytest.mark.slow]),
    ("deepseek_v3_671b_grpo", "deepseek_v3", [pytest.mark.slow]),
    ("glm45_355b_a32b_grpo", "glm45_355b_a32b", [pytest.mark.slow]),
    ("kimi_k2_1t_grpo", "kimi_k2", [pytest.mark.slow]),
    ("qwen3_next_80b_a3b_grpo", "qwen3_next_80b_a3b", [pytest.mark.slow]),
    ("qwen3_5_397b_a17b_grpo", "qwen3_5_397b_a17b", [pytest.mark.slow]),
    ("gpt_oss_120b_grpo", "gpt_oss_120b", [pytest.mark.slow]),
]


def _run(args: list[str], extra_env: dict | None = None) -> subprocess.CompletedProcess:
    unset = ("MODEL_DIR", "NNODES", "GPUS_PER_NODE", "DEVICE_MEMORY_GB")
    env = {k: v for k, v in os.environ.items() if k not in unset} | (extra_env or {})
    return subprocess.run(
        args, cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=900
    )


def _python(args: list[str]) -> subprocess.CompletedProcess:
    return _run([sys.executable, *args])


# The train scripts' dry runs in one process, each as ``launch.sh --dry-run`` runs it (its config, MCORE_RL_MODEL at
# the script's model in models/configs): the imports (6 s of CPU) once, not per script. The bash path of a dry run is
# the main job's test and the 40 GiB one below.
PLAN_ALL = """
import contextlib, json, os, sys
from mcore_rl.planner.__main__ import main

codes = {}
for config, model, out in json.loads(sys.argv[1]):
    os.environ["MCORE_RL_MODEL"] = f"models/configs/{model}"
    with open(out + ".log", "w") as log, contextlib.redirect_stdout(log):
        codes[config] = main([f"scripts/configs/{config}.yaml", "--json", out])
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def full_size_plans(request, tmp_path_factory) -> dict[str, tuple[int, Path]]:
    """config -> (the dry run's exit status, its JSON report), for the configs this session's tests ask."""
    asked = {
        item.callspec.params["config"]: item.callspec.params["model"]
        for item in request.session.items
        if item.originalname == "test_train_script_dry_run_maps_every_tensor_at_full_size"
    }
    root = tmp_path_factory.mktemp("plans")
    runs = [(config, model, str(root / f"{config}.json")) for config, model in asked.items()]
    run = _python(["-c", PLAN_ALL, json.dumps(runs)])
    assert run.returncode == 0, run.stderr[-4000:]
    codes = json.loads(run.stdout.strip().splitlines()[-1])
    return {config: (codes[config], Path(out)) for config, _, out in runs}


@pytest.mark.parametrize(("config", "model"), [pytest.param(c, m, marks=k) for c, m, k in CONFIGS])
def test_train_script_dry_run_maps_every_tensor_at_full_size(config, model, full_size_plans):
    script = (REPO / "scripts" / f"train_{config}.sh").read_text()
    assert f'launch {config} {model} "$@"' in script.splitlines()[-1]
    model_dir = REPO / "models" / "configs" / model
    code, out = full_size_plans[config]
    assert code == 0, Path(str(out) + ".log").read_text()
    report = json.loads(out.read_text())
    hf_config = json.loads((model_dir / "config.json").read_text())
    for name, role in report["roles"].items():
        assert role["errors"] == [], name
        # Every HF tensor is produced exactly once, at its shape: the export adds up to the checkpoint.
        assert role["exported_params"] == role["hf_params"], name
        # bf16, each tensor sent once; the MTP layers' are not (these scripts' engines do not draft with them)
        assert role["sync"]["total_bytes"] == 2 * role["engine_params"], name
        mtp = hf_config.get("num_nextn_predict_layers", 0)
        assert role["mtp_layers"] == mtp and (role["engine_params"] < role["hf_params"]) == bool(mtp)
        assert sum(role["stage_layers"]) == hf_config["num_hidden_layers"]
        assert len(role["stage_params"]) == role["layout"]["pp"]
    # Each script's layout fits the 80 GiB it is planned for, in every phase of an episode.
    memory = report["memory"]
    assert memory["fits"] and memory["device_bytes"] == 80 << 30
    assert all(sum(phase["parts"].values()) <= memory["device_bytes"] for phase in memory["phases"])


def test_a_broken_mapping_is_reported_by_name():
    """A bridge that forgets a projection and exports another twice: the check names both sides of each."""
    script = textwrap.dedent("""
        import json
        from converters.hf_io import read_config
        from converters.mapping import Direct
        from mcore_rl.planner.check import check_mappings
        from mcore_rl.planner.meta import hf_tensors, pipeline_stages
        from models.qwen3 import Qwen3Bridge
        from parallel.config import ParallelConfig

        class Broken(Qwen3Bridge):
            def mlp_mappings(self):
                kept = [m for m in super().mlp_mappings() if "linear_fc2" not in m.megatron]
                return kept + [Direct("decoder.layers.*.mlp.linear_fc2.weight", "model.layers.*.mlp.up_proj.weight", 1)]

        bridge = Broken(read_config("models/configs/qwen3_8b"))
        parallel = ParallelConfig(tp=2, pp=2)
        report = check_mappings(bridge, parallel, pipeline_stages(bridge, parallel, 8), hf_tensors(bridge.hf))
        print(json.dumps(report.errors))
    """)
    run = _python(["-c", script])
    assert run.returncode == 0, run.stderr
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert any(
        e.startswith(
            "36 unexpected tensor(s) with no Megatron parameter: model.layers.0.mlp.down_proj.weight (4096, 12288)"
        )
        for e in errors
    )
    assert (
        "shape mismatch: {'model.layers.0.mlp.up_proj.weight': (12288, 4096)} cannot form Megatron "
        "decoder.layers.0.mlp.linear_fc2.weight of shape (4096, 12288)" in errors
    )
    assert any(
        e.startswith("HF tensor model.layers.7.mlp.up_proj.weight is exported by several parameters") for e in errors
    )


def test_the_sync_plan_counts_the_mtp_layers_for_engines_that_draft_with_them():
    """DeepSeek-V3 at full size as its train script lays it out (TP 8, PP 8, EP 32 on 256 devices): without drafting the sync leaves the MTP layer
    out, with it (speculative decoding) every checkpoint tensor is sent once."""
    script = textwrap.dedent("""
        import json
        from converters.hf_io import read_config
        from mcore_rl.planner.dry_run import plan_role
        from mcore_rl.planner.meta import hf_tensors
        from models.registry import get_bridge
        from parallel.config import ParallelConfig

        bridge = get_bridge("models/configs/deepseek_v3")
        hf = hf_tensors(bridge.hf)
        parallel = ParallelConfig(tp=8, pp=8, ep=32, etp=1, sequence_parallel=True, last_stage_layers=5)
        plans = [plan_role(bridge, parallel, 256, 1 << 30, hf, drafts) for drafts in (False, True)]
        print(json.dumps([(p["sync"]["total_bytes"], p["engine_params"], p["hf_params"]) for p in plans]))
    """)
    run = _python(["-c", script])
    assert run.returncode == 0, run.stderr
    (plain, engine_plain, hf), (drafting, engine_drafting, _) = json.loads(run.stdout.strip().splitlines()[-1])
    assert plain == 2 * engine_plain and round(engine_plain / 1e9, 2) == 671.03
    assert drafting == 2 * engine_drafting == 2 * hf and round(hf / 1e9, 2) == 684.49


def test_every_train_script_is_dry_run_here():
    scripts = {p.name for p in (REPO / "scripts").glob("train_*.sh")}
    tested = {f"train_{c}.sh" for c, _, _ in CONFIGS} | {"train_smollm2_135m_grpo.sh", "train_tiny_deepseek_v3_grpo.sh"}
    assert scripts == tested


def test_main_job_dry_run_and_a_real_run_without_weights():
    for script in ("train_smollm2_135m_grpo.sh", "train_tiny_deepseek_v3_grpo.sh"):
        run = _run(["bash", f"scripts/{script}", "--dry-run"])
        assert run.returncode == 0 and "rollout sync" in run.stdout, run.stdout + run.stderr
    run = _run(["bash", "scripts/train_qwen3_8b_grpo.sh"])
    assert run.returncode == 2 and "set MODEL_DIR to the HF checkpoint of qwen3_8b" in run.stderr


def test_a_run_that_does_not_fit_stops_before_starting_with_layouts_that_would():
    """Qwen3-8B at TP 2 on 40 GiB devices: the dry run and the real run name the phases that do not fit and list
    layouts that do; the real run stops before any actor starts (there are no weights here to load)."""
    env = dict(DEVICE_MEMORY_GB="40")
    dry = _run(["bash", "scripts/train_qwen3_8b_grpo.sh", "--dry-run"], env)
    real = _run(["bash", "scripts/train_qwen3_8b_grpo.sh"], env | dict(MODEL_DIR=str(REPO / "models/configs/qwen3_8b")))
    assert dry.returncode == 1 and real.returncode == 2, dry.stderr + real.stderr
    for out in (dry.stdout, real.stderr):
        assert "does not fit: train: 48.4 GiB needed > 40.0 GiB" in out, out
        assert "trainer layouts that fit these devices (models.policy_trainer.parallel), best first:" in out
        assert "    {tp: 4, sequence_parallel: true}: peak" in out


def test_a_reward_model_and_a_critic_are_dry_run_at_full_size(tmp_path):
    """Qwen3-8B's script with a full-size Qwen3 reward model (its config.json alone) and PPO's critic: the reward
    model's role maps every tensor (its score head included) at its own layout, and the memory plan counts both."""
    model = REPO / "models" / "configs" / "qwen3_8b"
    rm = tmp_path / "rm"
    rm.mkdir()
    config = json.loads((model / "config.json").read_text())
    config |= {"architectures": ["Qwen3ForSequenceClassification"], "id2label": {"0": "LABEL_0"}}
    (rm / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    overrides = [f"models.reward_model.load={rm}", "models.reward_model.parallel.tp=4"]
    overrides += ["models.policy_trainer.advantage_estimator=gae", "models.critic.load=${models.policy_trainer.load}"]
    run = _run(["bash", "scripts/train_qwen3_8b_grpo.sh", "--dry-run", "--json", str(out), *overrides])
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    role = report["roles"]["reward_model"]
    assert role["errors"] == [] and role["exported_params"] == role["hf_params"] and role["layout"]["tp"] == 4
    phases = {p["name"]: p["parts"] for p in report["memory"]["phases"]}
    assert phases["rollout"]["reward model weights"] > 0 and phases["critic"]["critic weights+grads+optimizer"] > 0
