import ray
import torch

from mcore_rl.rollout.engine import RolloutConfig
from mcore_rl.rollout.remote import launch_engine, stop_engine
from tests.distributed.test_rollout_engine import KV_BYTES


def test_dump(ray_address, tiny_models):
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    actor = launch_engine(
        tiny_models["GptOssForCausalLM"], RolloutConfig(max_model_len=64, cpu_kv_cache_bytes=KV_BYTES), name="x"
    )
    try:
        scores = torch.tensor(ray.get(actor.score.remote(ids.tolist())))
    finally:
        stop_engine(actor)
    torch.save({"ids": ids, "scores": scores, "dir": tiny_models["GptOssForCausalLM"]}, "/tmp/scratch/vllm_gptoss.pt")
    import shutil

    shutil.copytree(tiny_models["GptOssForCausalLM"], "/tmp/scratch/gptoss_tiny", dirs_exist_ok=True)
