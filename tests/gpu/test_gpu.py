"""The GPU tier: each step of the GPU self-check (tests/gpu/checks.py) as a test; skipped without a CUDA device."""

import pytest
import torch

from tests.gpu import checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"),
]


@pytest.mark.parametrize("step", checks.STEPS, ids=[s.name for s in checks.STEPS])
def test_step(step):
    result = checks.run_step(step)
    if result["status"] == "SKIP":
        pytest.skip(result["detail"])
    assert result["status"] == "PASS", result.get("traceback", result["detail"])
