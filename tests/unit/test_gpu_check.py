"""The GPU self-check on this CPU machine: every step reports SKIP with its reason, then the summary line."""

import subprocess
from pathlib import Path

from tests.gpu.checks import STEPS

REPO = Path(__file__).resolve().parents[2]


def test_every_step_skips_without_a_cuda_device():
    run = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == len(STEPS) + 1, run.stdout
    for number, ((name, _), line) in enumerate(zip(STEPS, lines, strict=False), 1):
        assert line.startswith(f"[{number}/{len(STEPS)}] {name}: SKIP (") and line.endswith(
            "no CUDA device (torch.cuda.is_available() is False)"
        ), line
    assert lines[-1] == f"gpu_check: 0 passed, 0 failed, {len(STEPS)} skipped"
