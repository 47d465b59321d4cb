"""The GPU tier: each step of the GPU self-check (tests/gpu/checks.py) as a test; skipped without a CUDA device."""

import pytest
import torch

from tests.gpu import checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"),
]


@pytest.mark.parametrize("step", [f for _, f in checks.STEPS], ids=[n for n, _ in checks.STEPS])
def test_step(step):
    try:
        step()
    except checks.SkipStepError as why:
        pytest.skip(str(why))
