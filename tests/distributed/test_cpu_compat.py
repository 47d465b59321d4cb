"""Megatron-Core on CPU: no CUDA call site is reached by training steps over the layouts we support."""

import megatron.core
import pytest
import torch

from compat.megatron_core import cpu as megatron_core_cpu
from tests.distributed import cases

LAYOUTS = [
    ("LlamaForCausalLM", dict(tp=2, sequence_parallel=True)),
    ("LlamaForCausalLM", dict(pp=2, vpp=2)),
    ("Qwen3MoeForCausalLM", dict(tp=2, ep=2, sequence_parallel=True)),
]


@pytest.mark.parametrize(("arch", "layout"), LAYOUTS)
def test_training_step_reaches_no_cuda_call(ranks, tiny_models, arch, layout):
    tokens = torch.randint(0, 100, (8, 9), generator=torch.Generator().manual_seed(3))
    for hits in ranks.run(
        cases.cuda_call_sites,
        case="train_step",
        hf_dir=tiny_models[arch],
        layout=layout,
        tokens=tokens,
        micro_batch_size=2,
    ):
        assert hits == [], f"new CUDA call sites on the CPU path (cover them in compat/megatron_core/cpu.py): {hits}"


def test_other_megatron_versions_are_refused(monkeypatch):
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    monkeypatch.delattr(megatron.core, "_mcore_rl_installed", raising=False)
    with pytest.raises(RuntimeError, match=r"CPU support targets megatron-core==0.16.1, found 0.99.0"):
        megatron_core_cpu.install_cpu_compat()
