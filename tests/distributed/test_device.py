"""The CUDA branch of the trainer's device decisions, run on CPU ranks where Megatron-Core lets it run."""

import pytest
import torch

from tests.distributed import cases


def test_the_cuda_optimizer_arguments_build_megatrons_optimizer(ranks, tiny_models):
    """Defect 1: on CUDA the trainer asked Megatron-Core for its own gloo groups beside the explicit ones, which
    megatron-core 0.16.1 refuses; the CUDA branch's arguments build the optimizer and train like the CPU's."""
    hf_dir = tiny_models["LlamaForCausalLM"]
    refusals = ranks.run(cases.optimizer_with_megatrons_gloo_groups, hf_dir=hf_dir)
    assert refusals[0].startswith("Gloo process groups are not supported when pg_collection is provided")
    tokens = torch.randint(0, 100, (4, 9), generator=torch.Generator().manual_seed(1))
    kwargs = dict(hf_dir=hf_dir, layout=dict(tp=2), tokens=tokens, micro_batch_size=1)
    cpu = ranks.run(cases.train_step, **kwargs)[0]
    assert ranks.run(cases.train_step, device="cuda", **kwargs)[0] == pytest.approx(cpu, rel=1e-6)
