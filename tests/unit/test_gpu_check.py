"""The GPU self-check on this CPU machine: every step SKIPs with its reason (a missing package named before the
missing GPU), the report is JSON, and the runner's own process handling (a step's result, a crash, a hang, a
package that is absent) works on steps that need no GPU."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.gpu import checks
from tests.gpu.checks import NO_CUDA, STEPS, Step

REPO = Path(__file__).resolve().parents[2]

# Hides megatron from the self-check's processes, as on a GPU machine where it was not installed.
NO_MEGATRON = """
import sys

class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, _Hide())
"""


def _gpu_check(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[list[str], dict]:
    report = tmp_path / "r.json"
    run = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_check.sh"), "--report", str(report), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.strip().splitlines(), json.loads(report.read_text())


def test_every_step_skips_without_a_cuda_device_and_the_report_says_why(tmp_path):
    lines, report = _gpu_check(tmp_path)
    assert len(lines) == len(STEPS) + 1, lines
    for number, (step, line) in enumerate(zip(STEPS, lines, strict=False), 1):
        assert line.startswith(f"[{number}/{len(STEPS)}] {step.name}: SKIP (") and line.endswith(NO_CUDA), line
    assert lines[-1] == f"gpu_check: 0 passed, 0 failed, {len(STEPS)} skipped"
    assert [s["name"] for s in report["steps"]] == [s.name for s in STEPS]
    assert {s["status"] for s in report["steps"]} == {"SKIP"} and report["summary"]["SKIP"] == len(STEPS)
    machine = report["machine"]
    assert machine["gpu"] is None and machine["torch"].startswith("2.") and machine["python"].count(".") == 2
    assert machine["packages"]["megatron-core"] == "0.16.1" and machine["dev_shm_bytes"] > 0


def test_without_megatron_its_steps_skip_naming_it_and_none_fails(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_MEGATRON)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    lines, report = _gpu_check(tmp_path, env=env)
    for step, result in zip(STEPS, report["steps"], strict=True):
        want = "needs megatron.core, which is not installed" if "megatron.core" in step.needs else NO_CUDA
        assert result["status"] == "SKIP" and result["detail"] == want, result
    assert lines[-1] == f"gpu_check: 0 passed, 0 failed, {len(STEPS)} skipped"


def test_the_two_commands_split_the_steps(capsys):
    assert checks.main(["--command", "1"]) == checks.main(["--command", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    names = [line.split("] ")[1].split(":")[0] for line in lines]
    assert names == [s.name for s in STEPS if s.command == 1] + [s.name for s in STEPS if s.command == 2]
    assert names[:2] == ["environment", "offload"] and sorted(names) == sorted(s.name for s in STEPS)


# Steps without a GPU, run the way the runner runs every step: each in its own process.
def passes() -> tuple[str, dict]:
    return "fine", {"max_abs_diff": 0.25}


def lacks_a_package() -> str:
    import a_package_this_machine_lacks  # noqa: F401

    return "unreachable"


def fails() -> str:
    raise ValueError("the numbers differ")


def crashes() -> str:
    os._exit(3)


def hangs() -> str:
    import time

    time.sleep(600)
    return "unreachable"


def test_each_step_runs_in_its_own_process_under_its_time_limit():
    def run(fn, timeout_s=120):
        return checks._in_own_process(Step(fn.__name__, fn, (), timeout_s, 1, cuda=False))

    assert run(passes) == {"status": "PASS", "detail": "fine", "numbers": {"max_abs_diff": 0.25}}
    assert run(lacks_a_package) == {
        "status": "SKIP",
        "detail": "needs a_package_this_machine_lacks, which is not installed",
    }
    failed = run(fails)
    assert failed["status"] == "FAIL" and failed["detail"] == "ValueError: the numbers differ"
    assert 'raise ValueError("the numbers differ")' in failed["traceback"]
    crashed = run(crashes)
    assert crashed["status"] == "FAIL" and crashed["detail"] == "its process exited with status 3 before reporting"
    hung = run(hangs, timeout_s=5)
    assert (hung["status"], hung["detail"]) == ("FAIL", "did not finish within 5 s")
    assert checks._in_own_process(Step("gpu", passes, ("a_package_this_machine_lacks",), 60, 1))["detail"] == (
        "needs a_package_this_machine_lacks, which is not installed"  # checked before a process starts
    )


def test_the_megatron_steps_import_without_ray():
    """The modules the Megatron steps import must not need Ray (a GPU machine's Python may lack it)."""
    code = textwrap.dedent(
        """
        import sys
        class _Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ModuleNotFoundError(name, name=name)
        sys.meta_path.insert(0, _Hide())
        import converters.stream, mcore_rl.trainer.policy, mcore_rl.trainer.value, mcore_rl.trainer.offload
        import mcore_rl.rollout.transport, parallel.transfer, models.registry
        print("imported")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.stdout.strip() == "imported", run.stderr[-3000:]


def _stub_wheel(directory: Path, name: str, version: str) -> None:
    """A wheel that only says ``name`` ``version`` is installed: what the GPU machine already has."""
    import zipfile

    stem = f"{name.replace('-', '_')}-{version}"  # a wheel's file name spells the project's dashes as underscores
    info = f"{stem}.dist-info"
    with zipfile.ZipFile(directory / f"{stem}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


def test_the_offline_wheels_resolve_for_python_3_12_with_the_machines_torch_from_that_directory_alone(tmp_path):
    """The offline route: scripts/gpu_wheels.sh fills a directory under 16 MiB, and pip, told the target is CPython
    3.12 on manylinux x86-64 with the GPU image's torch, numpy, packaging, attrs and typing-extensions present (stub
    wheels of their versions there), resolves megatron-core and jsonschema (the run config's tool schemas: without it
    the training steps SKIPped on an H100) from that directory and the stubs alone."""
    wheels, present = tmp_path / "wheels", tmp_path / "present"
    run = subprocess.run(["bash", str(REPO / "scripts/gpu_wheels.sh"), str(wheels)], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    size = sum(f.stat().st_size for f in wheels.glob("*.whl"))
    assert 0 < size < 16 << 20, size
    present.mkdir()
    image = {"torch": "2.11.0", "numpy": "2.5.2", "packaging": "25.0", "attrs": "25.4.0", "typing-extensions": "4.15.0"}
    for name, version in image.items():  # the GPU image's (KINDS.md)
        _stub_wheel(present, name, version)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report", str(report),
         "--no-index", "--find-links", str(wheels), "--find-links", str(present), "--only-binary=:all:",
         "--implementation", "cp", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
         "--platform", "manylinux_2_17_x86_64", "--target", str(tmp_path / "target"), "megatron-core==0.16.1",
         "jsonschema==4.26.0"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    resolved = {i["metadata"]["name"]: i["download_info"]["url"] for i in json.loads(report.read_text())["install"]}
    carried = {"megatron-core", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py"}
    assert resolved.keys() == carried | image.keys(), resolved
    assert all(resolved[n].startswith(wheels.as_uri()) for n in carried), resolved
    assert "cp312" in resolved["megatron-core"] and "cp312" in resolved["rpds-py"], resolved
    assert all(resolved[n].startswith(present.as_uri()) for n in image), resolved


def test_gpu_check_installs_given_wheels_for_its_run_only(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    run = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--wheels", str(wheels)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and "gpu_check: no wheels in" in run.stderr, run.stderr
    _stub_wheel(wheels, "mcore_rl_probe", "1.0")
    lines, report = _gpu_check(tmp_path, "--wheels", str(wheels), "environment")
    assert lines[-1] == "gpu_check: 0 passed, 0 failed, 1 skipped" and report["warnings"] == []
    assert subprocess.run([sys.executable, "-m", "pip", "show", "mcore_rl_probe"], capture_output=True).returncode == 1


def test_the_smollm2_shaped_model_has_smollm2s_shape_and_log_probs_that_spread(tmp_path):
    """Without the embedded model the Megatron-vs-HF step uses a SmolLM2-shaped model with seeded random weights:
    the real model's config (unpadded vocabulary, tied embeddings, 9 / 3 heads) and log-probs spread over several
    nats, so a wrong mapping cannot hide in a near-uniform output."""
    import transformers

    from converters.gguf2hf import default_model_dir
    from models.registry import get_bridge

    shaped = json.loads((checks.SMOLLM2_SHAPED / "config.json").read_text())
    real = json.loads((default_model_dir() / "config.json").read_text())
    assert {key: real[key] for key in shaped} == shaped
    directory = checks.smollm2_shaped(tmp_path / "shaped")
    assert get_bridge(str(directory)).vocab_size == 49152
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokens = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logprobs = checks._logprobs(model(tokens).logits, tokens)
    assert logprobs.max() - logprobs.min() > 5 and logprobs.std() > 1, (logprobs.min(), logprobs.max())


def test_the_tiny_moe_step_runs_its_checks_on_cpu():
    """The MoE step's logic, run before a GPU is lent (defects 4 and 5): grouped experts against sequential ones in
    bf16 as well as fp32, within the stated tolerances, and routing replay with the same experts within 1e-5."""
    step = next(s for s in STEPS if s.name == "tiny_moe")
    result = checks._in_own_process(Step(step.name, step.run, step.needs, step.timeout_s, step.command, cuda=False))
    assert result["status"] == "PASS", result.get("traceback", result["detail"])
    numbers = result["numbers"]
    for arch in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
        for dtype in ("float32", "bfloat16"):
            loss_tolerance, grad_tolerance = checks.GROUPED_TOLERANCE[getattr(torch, dtype)]
            assert numbers[f"{arch}_{dtype}"]["loss_abs_diff"] <= loss_tolerance
            assert numbers[f"{arch}_{dtype}"]["grad_rel_diff"] <= grad_tolerance
        assert numbers[f"{arch}_replay_max_abs_logit_diff"] <= checks.REPLAY_TOLERANCE


def test_the_new_families_step_runs_its_checks_on_cpu():
    """GLM-4.5, Kimi-K2, Qwen3-Next and Qwen3.5 on the GPU step's path, run before a GPU is lent: logits equal transformers',
    packed log-probs equal padded ones (Qwen3-Next's Gated DeltaNet through compat.fla's kernel here)."""
    step = next(s for s in STEPS if s.name == "new_families")
    result = checks._in_own_process(Step(step.name, step.run, step.needs, step.timeout_s, step.command, cuda=False))
    assert result["status"] == "PASS", result.get("traceback", result["detail"])
    numbers = result["numbers"]
    assert numbers["gated_delta_rule"] == "compat.fla"
    for family in ("Glm4MoeForCausalLM", "KimiK2", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"):
        assert max(numbers[f"{family}_local"].values()) <= checks.FAMILY_TOLERANCE


@pytest.fixture(scope="module")
def shaped_2_layers(tmp_path_factory) -> str:
    """SmolLM2's shape (vocabulary, heads, tied embeddings) in 2 layers: the steps' logic at a fifteenth of the
    real model's layers (the GPU run takes the embedded model itself)."""
    return str(checks.smollm2_shaped(tmp_path_factory.mktemp("shaped") / "model", layers=2))


def test_the_critic_step_runs_its_checks_on_cpu(shaped_2_layers, monkeypatch):
    """The critic step's logic, run before a GPU is lent: on a SmolLM2-shaped model in fp32 the role's values equal
    the same head on HF's hidden states (to fp32 rounding), and three value-loss steps lower the loss."""
    monkeypatch.setenv(checks.MODEL_ENV, shaped_2_layers)
    step = next(s for s in STEPS if s.name == "critic")
    result = checks._in_own_process(Step(step.name, step.run, step.needs, step.timeout_s, step.command, cuda=False))
    assert result["status"] == "PASS", result.get("traceback", result["detail"])
    assert result["numbers"]["values"]["max_abs_diff"] < 1e-4
    losses = result["numbers"]["value_losses"]
    assert losses == sorted(losses, reverse=True) and result["numbers"]["offloaded_bytes"] == 0


def test_the_lora_step_runs_its_checks_on_cpu(shaped_2_layers, monkeypatch):
    """The LoRA step's logic, run before a GPU is lent: on a SmolLM2-shaped model in fp32 only the adapters train,
    the base model stays the policy's start, the merge is W + scale B A and the checkpoint resumes exactly."""
    monkeypatch.setenv(checks.MODEL_ENV, shaped_2_layers)
    step = next(s for s in STEPS if s.name == "lora")
    result = checks._in_own_process(Step(step.name, step.run, step.needs, step.timeout_s, step.command, cuda=False))
    assert result["status"] == "PASS", result.get("traceback", result["detail"])
    numbers = result["numbers"]
    assert 0 < numbers["trained_params"] < numbers["frozen_params"] / 10 and numbers["policy_moved"] > 0
    assert numbers["merge_error"] < 1e-6 and numbers["offloaded_bytes"] == 0


def test_the_mtp_step_runs_its_checks_on_cpu():
    """The MTP step's logic, run before a GPU is lent: the MTP block's log-probs equal the independent forward in
    fp32, and only a step with mtp_loss_coef moves the MTP layers."""
    step = next(s for s in STEPS if s.name == "mtp")
    result = checks._in_own_process(Step(step.name, step.run, step.needs, step.timeout_s, step.command, cuda=False))
    assert result["status"] == "PASS", result.get("traceback", result["detail"])
    numbers = result["numbers"]
    assert numbers["local_max_abs_logprob_diff"] < 1e-5 and numbers["mtp_weights_moved"] > 0
