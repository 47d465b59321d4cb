"""Full-size models on the meta device: shapes without memory, so a 671B layout is checked on a laptop.

Megatron's side: every pipeline rank's parameters, built by the bridge under a fake process group of the run's
world size (collectives are no-ops; Megatron's parallel state is real). TP, CP, EP and DP peers of a pipeline
rank hold same-shaped shards, so rank 0 of each is built and the others are named from it
(:func:`converters.plan.global_expert_name`). HF's side: transformers' own model for the same config.json, the
independent account of what a checkpoint holds.
"""

from __future__ import annotations

import torch
import transformers
from megatron.core import parallel_state
from transformers.core_model_loading import revert_weight_conversion

from converters.plan import LocalParam, local_params
from parallel.config import ParallelConfig
from parallel.groups import fake_world, init_parallel

# config.json keys that make transformers build something other than the bf16 architecture: FP8 checkpoints
# (DeepSeek-V3's quantization_config) hold the same tensor names and shapes plus scales.
_NOT_ARCHITECTURE = ("quantization_config", "auto_map")


def pipeline_stages(
    bridge, parallel: ParallelConfig, world_size: int, dtype: torch.dtype = torch.bfloat16
) -> list[list[LocalParam]]:
    """Per pipeline rank: the parameters one of its devices holds (under global layer names), on meta."""
    stages = []
    per_stage = world_size // parallel.pp
    for pp_rank in range(parallel.pp):
        with fake_world(world_size, pp_rank * per_stage):
            init_parallel(parallel)
            if parallel_state.get_pipeline_model_parallel_rank() != pp_rank:
                raise RuntimeError(f"rank {pp_rank * per_stage} is not on pipeline stage {pp_rank}")
            config = bridge.transformer_config(parallel, params_dtype=dtype)
            stages.append(local_params(bridge.build_model(config, backend="local", meta=True)))
    return stages


def hf_tensors(hf_config: dict) -> dict[str, torch.Size]:
    """Name and shape of every tensor a checkpoint of ``hf_config`` (a config.json's dict) holds, as
    transformers saves its model: in the checkpoint layout (per-expert tensors, not transformers 5's fused
    in-memory experts), a family's stacked experts as the mappings see them (per expert, :mod:`converters.stacks`)."""
    from models.registry import get_bridge

    bridge = get_bridge(hf_config)
    fields = {k: v for k, v in hf_config.items() if k not in _NOT_ARCHITECTURE}
    # MTP layers: transformers builds none; their decoder layers are as many more of its own, after the model's
    fields["num_hidden_layers"] = hf_config["num_hidden_layers"] + bridge.num_mtp_layers
    fields["model_type"] = bridge.transformers_model_type or bridge.model_type
    config = transformers.AutoConfig.for_model(**fields)
    # a reward model: the family's sequence classifier (a score head where the causal LM has its LM head)
    auto = "AutoModelForSequenceClassification" if bridge.value_model else "AutoModelForCausalLM"
    with torch.device("meta"):
        model = getattr(transformers, auto).from_config(config)
    saved = revert_weight_conversion(model, model.state_dict())
    shapes = {name: tensor.shape for name, tensor in saved.items()} | bridge.mtp_own_tensors()
    stacks = bridge.expert_stacks()
    return shapes if stacks is None else stacks.split(shapes)
