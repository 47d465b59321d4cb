"""Full-size dry runs on meta tensors: every train config's layout, its whole HF <-> Megatron mapping and its
rollout-sync plan, checked against transformers' own model of the public config.json. Each run is a subprocess
(a fake process group of the config's device count)."""

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
]


def _python(args: list[str], model: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), MCORE_RL_MODEL=model)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize(("config", "model"), [pytest.param(c, m, marks=k) for c, m, k in CONFIGS])
def test_train_config_maps_every_tensor_at_full_size(config, model, tmp_path):
    out = tmp_path / "plan.json"
    model_dir = REPO / "models" / "configs" / model
    run = _python(["-m", "mcore_rl.planner", f"scripts/configs/{config}.yaml", "--json", str(out)], str(model_dir))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    hf_config = json.loads((model_dir / "config.json").read_text())
    for name, role in report["roles"].items():
        assert role["errors"] == [], name
        # Every HF tensor is produced exactly once, at its shape: the export adds up to the checkpoint.
        assert role["exported_params"] == role["hf_params"], name
        assert role["sync"]["total_bytes"] == 2 * role["hf_params"], name  # bf16, each tensor sent once
        assert sum(role["stage_layers"]) == hf_config["num_hidden_layers"]
        assert len(role["stage_params"]) == role["layout"]["pp"]


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
    assert "HF tensor model.layers.35.mlp.down_proj.weight (4096, 12288) has no Megatron parameter" in errors
    assert any(
        e.startswith("decoder.layers.0.mlp.linear_fc2.weight -> model.layers.0.mlp.up_proj.weight: shape")
        for e in errors
    )
    assert any(
        e.startswith("HF tensor model.layers.7.mlp.up_proj.weight is exported by several parameters") for e in errors
    )
