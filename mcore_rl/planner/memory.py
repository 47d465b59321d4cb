"""Per-device memory of a run (colocated, or per device pool where the engines, a reward model or a judge have their
own), from the model's config.json and the run config alone (no model is built): what each role holds in each
phase of an episode, whether it fits a device, and which layouts would.

Everything is counted per device of the busiest pipeline rank:

* trainer: bf16 weights, fp32 gradients (``grad_reduce_in_fp32``), the distributed optimizer's fp32 main weights and
  Adam moments sharded over DP x CP (dense) or the expert-data-parallel group (experts), and the activations
  the pipeline schedule keeps alive (1F1B: ``pp - rank`` micro-batches; interleaved: Megatron's warm-up count);
* reference, teacher, reward model: bf16 weights; critic: as the trainer, with a value head for the LM head;
* rollout engine, and a judge's own: the ``gpu_memory_utilization`` share vLLM takes, of which weights and working
  memory, the rest KV cache (GQA: ``2 L kv_heads/TP d`` per token; MLA: the latent ``L (kv_lora + rope)``,
  replicated over TP).

Parameters come from :mod:`mcore_rl.planner.params` (exact), activations from
:mod:`mcore_rl.planner.activations`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from mcore_rl.planner.activations import (
    device_tokens,
    head_activation_bytes,
    layer_activation_bytes,
    lm_head_backward_bytes,
)
from mcore_rl.planner.params import (
    Architecture,
    lora_params,
    mtp_params,
    optimizer_shards,
    rank_layers,
    stage_params,
    trained_router,
)
from models.registry import get_bridge
from parallel.config import ParallelConfig, divisors

GiB = 1 << 30


# ---- roles and phases ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What a step asks of memory, from the run config."""

    micro_batch_tokens: int  # tokens of one micro-batch (a pack, or micro_batch_size x the longest sample)
    micro_batches: int  # per data-parallel rank and optimizer step
    recompute: bool = False  # full activation recomputation: a layer keeps only its input
    sequence: int = 0  # the longest sample (bounds the mean sequence length)

    @classmethod
    def from_config(cls, config) -> Workload:
        rt, m = config.runtime_args, config.models
        trainer = m.policy_trainer
        longest = config.longest_sample
        dp = trainer.parallel.dp(rt.trainer_devices)
        rows = rt.train_global_batch_size // dp
        if trainer.max_token_in_packing:
            tokens = trainer.max_token_in_packing
            micro_batches = max(1, math.ceil(rows * longest / tokens))
        else:
            tokens = trainer.micro_batch_size * longest
            micro_batches = rows // trainer.micro_batch_size
        return cls(tokens, micro_batches, trainer.recompute == "full", longest)


def in_flight(parallel: ParallelConfig, rank: int, micro_batches: int) -> float:
    """Micro-batches whose activations pipeline ``rank`` holds at once, in units of its whole stage."""
    pp, vpp = parallel.pp, parallel.vpp
    if vpp == 1:
        return min(pp - rank, micro_batches)
    warmup = (pp - rank - 1) * 2 + (vpp - 1) * pp + 1  # Megatron's interleaved warm-up, in model chunks
    return min(warmup, micro_batches * vpp) / vpp


@dataclass(frozen=True)
class TrainerMemory:
    weights: int
    grads: int
    optimizer: int
    activations: int  # peak of the step (the busiest pipeline rank)
    scoring: int  # forward-only log-probs: one layer's working set and the logits

    @property
    def static(self) -> int:
        return self.weights + self.grads + self.optimizer


def trainer_memory(
    a: Architecture,
    parallel: ParallelConfig,
    world: int,
    work: Workload,
    *,
    backend: str = "te",
    param_bytes: int = 2,
    lora=None,
    mtp_loss_coef: float = 0.0,
) -> TrainerMemory:
    """Per-device bytes of a trainer rank at ``parallel`` (the pipeline rank with the largest total); with ``lora``
    adapters (a LoRAConfig of rank > 0) only they have gradients and optimizer state. MTP layers train (gradients,
    optimizer state, their layer's activations and logits) only with ``mtp_loss_coef``."""
    dp_cp, expert_dp = optimizer_shards(parallel, world)
    opt_per_param = 8 + (4 if param_bytes != 4 else 0)  # Adam moments (+ fp32 main weights of bf16 parameters)
    tokens = work.micro_batch_tokens
    _, st = device_tokens(parallel, tokens)
    best = None
    for rank, ((params, experts), layers) in enumerate(
        zip(stage_params(a, parallel), rank_layers(parallel, a.layers), strict=True)
    ):
        per_layer = [
            layer_activation_bytes(a, a.moe_layers[i], parallel, tokens, backend, param_bytes, work.sequence)
            for i in layers
        ]
        layer_inputs = st * a.hidden * param_bytes
        kept = layer_inputs * len(layers) + max(per_layer) if work.recompute else sum(per_layer)
        acts = in_flight(parallel, rank, work.micro_batches) * kept
        head, frozen = 0.0, (0, 0)
        if rank == parallel.pp - 1:
            head = head_activation_bytes(a, parallel, tokens, backend, param_bytes)
            logits = lm_head_backward_bytes(a, parallel, tokens, param_bytes)
            acts += head + logits
            if a.mtp_layers and mtp_loss_coef:  # per MTP layer: a layer's activations and logits more
                mtp_layer = layer_activation_bytes(a, a.moe_layers[-1], parallel, tokens, backend, param_bytes)
                acts += a.mtp_layers * in_flight(parallel, rank, work.micro_batches) * (mtp_layer + logits)
            elif a.mtp_layers:
                frozen = mtp_params(a, parallel)
        if lora is not None and lora.rank:
            counts = [lora_params(a, a.moe_layers[i], parallel, lora) for i in layers]
            adapters, expert_adapters = sum(c for c, _ in counts), sum(e for _, e in counts)
            routers, copies = map(sum, zip(*(trained_router(a, a.moe_layers[i], lora) for i in layers), strict=True))
            params, trained, trained_experts = params + adapters + copies, adapters + routers, expert_adapters
        else:
            trained, trained_experts = params - frozen[0], experts - frozen[1]
        memory = TrainerMemory(
            weights=params * param_bytes,
            grads=trained * 4,
            optimizer=int(
                (trained - trained_experts) * opt_per_param / dp_cp + trained_experts * opt_per_param / expert_dp
            ),
            activations=int(acts),
            scoring=int(max(per_layer) + head * 2),
        )
        if best is None or memory.static + memory.activations > best.static + best.activations:
            best = memory
    return best


@dataclass(frozen=True)
class EngineMemory:
    share: int  # what vLLM takes: gpu_memory_utilization x device
    weights: int
    working: int  # activations and sampler at the engine's batch limits
    kv_bytes_per_token: int
    kv_tokens: int  # tokens the KV cache holds (negative: the share does not cover weights and working memory)


def engine_memory(a: Architecture, rollout, device_bytes: int, max_num_seqs: int = 256) -> EngineMemory:
    """One rollout engine's device share at ``rollout`` (a RolloutConfig): bf16 weights split over its TP, vLLM's
    profiled working memory (``max_num_batched_tokens`` of activations, ``max_num_seqs`` rows of sampler logits and,
    for Gated DeltaNet layers, as many recurrent states), and the KV cache of the attention layers in the rest."""
    tp = rollout.tensor_parallel_size
    share = int(rollout.gpu_memory_utilization * device_bytes)
    weights = a.engine_params(bool(rollout.speculative_tokens)) * 2 // tp
    batched = max(8192, rollout.max_model_len)
    mlp = a.topk * a.moe_ffn if a.experts else a.ffn
    working = batched * (16 * a.hidden + 6 * mlp // tp) + max_num_seqs * a.vocab * 12
    attention = a.layers - sum(a.linear_layers)  # Gated DeltaNet layers keep a state per sequence instead
    if a.mla:
        per_token = attention * (a.kv_lora + a.rope_dim) * 2
    else:
        per_token = 2 * attention * max(1, a.kv_heads // tp) * a.head_dim * 2
    # a Gated DeltaNet state (fp32) per sequence and layer, for as many sequences as the engine may run at once
    states = (
        max_num_seqs * sum(a.linear_layers) * a.linear_value_heads * a.linear_key_dim * a.linear_value_dim * 4 // tp
    )
    working += states
    return EngineMemory(share, weights, working, per_token, (share - weights - working) // per_token)


@dataclass(frozen=True)
class Phase:
    name: str
    parts: dict[str, int]  # what is resident, by owner

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryPlan:
    device_bytes: int
    trainer: TrainerMemory
    ref_weights: int  # 0 without a reference model
    engine: EngineMemory
    phases: list[Phase]
    problems: list[str]  # why it does not fit (empty: it fits)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


def plan_memory(
    config, device_bytes: int, *, backend: str = "te", reserve_bytes: int = 5 * GiB, arch: Architecture | None = None
) -> MemoryPlan:
    """Every phase of a colocated episode on one device of ``config`` (a RunConfig), with the trainer's offload as
    configured (:func:`mcore_rl.driver.learn` moves weights and optimizer state apart; the scoring roles and the
    critic leave whole; a reward model comes on during the rollout, beside the engines' share). ``reserve_bytes``
    stands for the CUDA context, NCCL buffers and allocator fragmentation."""
    m, world = config.models, config.runtime_args.trainer_devices
    a = arch or Architecture.from_bridge(get_bridge(m.policy_trainer.load))
    work = Workload.from_config(config)
    trainer = trainer_memory(
        a, m.policy_trainer.parallel, world, work, backend=backend, lora=m.policy_trainer.lora,
        mtp_loss_coef=m.policy_trainer.mtp_loss_coef,
    )  # fmt: skip

    def arch_of(load: str) -> Architecture:
        return a if load == m.policy_trainer.load else Architecture.from_bridge(get_bridge(load))

    def bf16_weights(section) -> int:  # a scoring role's weights on its busiest device
        return max(p for p, _ in stage_params(arch_of(section.load), section.parallel)) * 2

    scoring = {}  # bf16 weights of the roles that only score: name -> bytes
    for role, name in (("ref_policy", "reference weights"), ("teacher", "teacher weights")):
        if m.uses(role):
            scoring[name] = bf16_weights(getattr(m, role))
    rt = config.runtime_args
    own = []  # the phases of the pools of a reward model and a judge with devices of their own
    # a reward model scores conversations during the rollout, beside the engines
    reward_model = {"reward model weights": bf16_weights(m.reward_model)} if m.uses("reward_model") else {}
    if rt.reward_model_devices:
        own.append(Phase("score (reward model devices)", reward_model | {"reserve": reserve_bytes}))
        reward_model = {}
    judge, judge_engine = {}, None  # a judge's own engines beside the policy's: their share while those are awake
    if m.judge.own_engines:
        judge_arch = Architecture.from_bridge(get_bridge(m.judge.load))
        judge_engine = engine_memory(judge_arch, m.judge.engine_config(m.policy.rollout), device_bytes)
        judge = {"judge engine share": judge_engine.share}
        if rt.judge_devices:
            own.append(Phase("judge (judge devices)", judge | {"reserve": reserve_bytes}))
            judge = {}
    critic = None
    if m.uses("critic"):
        critic_arch = dataclasses.replace(arch_of(m.critic.load), value_head=True)  # its LM head is dropped
        critic = trainer_memory(critic_arch, m.critic.parallel, world, work, backend=backend)
    ref = scoring.get("reference weights", 0)
    engine = engine_memory(a, m.policy.rollout, device_bytes)
    if not rt.colocated:
        plan = _disaggregated(
            m, trainer, ref, scoring | reward_model, critic, engine, judge, device_bytes, reserve_bytes
        )
        return _with_pools(plan, own, judge_engine, m.judge.max_model_len)
    phases = _colocated_phases(m, trainer, critic, engine, scoring, reward_model, judge, reserve_bytes)
    plan = MemoryPlan(device_bytes, trainer, ref, engine, phases, _problems(m, phases, engine, device_bytes))
    return _with_pools(plan, own, judge_engine, m.judge.max_model_len)


def _colocated_phases(m, trainer, critic, engine, scoring: dict, reward_model: dict, judge: dict,
                      reserve_bytes: int) -> list[Phase]:  # fmt: skip
    """The phases of a colocated episode on one trainer device: rollout, log-probs, critic, train, sync."""
    offload = m.policy_trainer.offload
    resident = {"trainer (offloaded)": 0} if offload else {"trainer weights+grads+optimizer": trainer.static}
    # outside the step: with offload, the weights without the optimizer state and gradients
    weights_only = (
        {"trainer weights": trainer.weights} if offload else {"trainer weights+grads+optimizer": trainer.static}
    )
    critic_state = {"critic weights+grads+optimizer": critic.static} if critic else {}
    others = {} if offload else scoring | reward_model | critic_state
    # Every trainer rank keeps two sync buffers for the whole run (the first sync's allocation is reused).
    fixed = {"sync buffers": 2 * m.policy.sync.bucket_bytes, "reserve": reserve_bytes}
    phases = [
        # also the sync's probe: the engines' KV caches wake once the trainer's weights have left
        Phase("rollout", {"engine share": engine.share} | judge | resident | (others or reward_model) | fixed),
        Phase(  # with offload, the optimizer state stays off the device until the step; one scoring role at a time
            "log-probs",
            weights_only
            | (others or {"largest scoring role": max(scoring.values(), default=0)})
            | {"scoring": trainer.scoring}
            | fixed,
        ),
    ]
    if critic:
        whole = {"critic weights+grads+optimizer": critic.static}
        phases.append(Phase("critic", weights_only | others | whole | {"activations": critic.activations} | fixed))
    phases += [
        Phase(
            "train",
            {"trainer weights+grads+optimizer": trainer.static, "activations": trainer.activations} | others | fixed,
        ),
        # with offload, the optimizer state and gradients leave before the engine's weights arrive
        Phase("sync", weights_only | {"engine weights": engine.weights} | others | fixed),
    ]
    return phases


def _with_pools(plan: MemoryPlan, own: list[Phase], judge: EngineMemory | None, judge_len: int) -> MemoryPlan:
    """``plan`` with the phases of the devices of a reward model or judge of their own, and their problems; a
    judge's engine whose KV cache cannot hold its ``judge_len`` tokens of context is one."""
    problems = _over(own, plan.device_bytes)
    if judge is not None and judge.kv_tokens < judge_len:
        problems.append(
            f"judge: the KV cache holds {max(judge.kv_tokens, 0)} tokens per engine, below models.judge.max_model_len"
            f"={judge_len} (share {judge.share / GiB:.1f} GiB, weights {judge.weights / GiB:.1f}); raise "
            "models.judge.gpu_memory_utilization or tensor_parallel_size"
        )
    return dataclasses.replace(plan, phases=plan.phases + own, problems=plan.problems + problems)


def _disaggregated(
    m, trainer, ref: int, scoring: dict, critic, engine: EngineMemory, judge: dict, device_bytes: int, reserve: int
):
    """The phases of each pool when the engines have devices of their own: the trainer, the scoring roles and the
    critic stay resident on theirs (nothing else comes), rank 0 keeps one broadcast buffer; an engine device holds
    the engine's share alone, or beside a judge's engine share."""
    resident = {"trainer weights+grads+optimizer": trainer.static} | scoring
    if critic:
        resident["critic weights+grads+optimizer"] = critic.static
    fixed = {"sync buffer": m.policy.sync.bucket_bytes, "reserve": reserve}
    phases = [
        Phase("rollout (rollout devices)", {"engine share": engine.share} | judge | {"reserve": reserve}),
        Phase("log-probs", resident | {"scoring": trainer.scoring} | fixed),
        Phase(
            "train", resident | {"activations": max(trainer.activations, critic.activations if critic else 0)} | fixed
        ),
    ]
    return MemoryPlan(device_bytes, trainer, ref, engine, phases, _problems(m, phases, engine, device_bytes))


def _over(phases: list[Phase], device_bytes: int) -> list[str]:
    """The phases that do not fit the device, with their parts."""
    return [
        f"{p.name}: {p.total / GiB:.1f} GiB needed > {device_bytes / GiB:.1f} GiB ("
        + ", ".join(f"{k} {v / GiB:.1f}" for k, v in p.parts.items() if v)
        + ")"
        for p in phases
        if p.total > device_bytes
    ]


def _problems(m, phases: list[Phase], engine: EngineMemory, device_bytes: int) -> list[str]:
    problems = _over(phases, device_bytes)
    if engine.kv_tokens < m.policy.rollout.max_model_len:
        problems.append(
            f"rollout: the KV cache holds {max(engine.kv_tokens, 0)} tokens per engine, below max_model_len="
            f"{m.policy.rollout.max_model_len} (share {engine.share / GiB:.1f} GiB: weights "
            f"{engine.weights / GiB:.1f}, working {engine.working / GiB:.1f}); raise "
            "models.policy.rollout.gpu_memory_utilization or tensor_parallel_size"
        )
    return problems


def suggest_layouts(config, device_bytes: int, *, limit: int = 5, **kwargs) -> list[tuple[ParallelConfig, int]]:
    """Trainer layouts for ``config``'s model and devices that fit, best first: the least model parallelism (the
    most data parallelism), then fewer pipeline stages, then the lowest peak; each with its peak bytes."""
    a = Architecture.from_bridge(get_bridge(config.models.policy_trainer.load))
    world = config.runtime_args.trainer_devices
    found = []
    for tp in divisors(min(world, 8)):  # TP within a node
        for pp in [p for p in divisors(world // tp) if p <= a.layers]:
            for ep in divisors(a.experts) if a.experts else [1]:
                try:  # the run's own validation: the layout against the model and the devices
                    parallel = _layout(a, tp, pp, ep)
                    trial = _with_layout(config, parallel)
                    trial.validate()
                except ValueError:
                    continue
                plan = plan_memory(trial, device_bytes, arch=a, **kwargs)
                if plan.fits:
                    found.append((tp * pp, pp, plan.peak.total, parallel))
    found.sort(key=lambda f: f[:3])
    return [(parallel, peak) for _, _, peak, parallel in found[:limit]]


def _layout(a: Architecture, tp: int, pp: int, ep: int) -> ParallelConfig:
    base = dict(tp=tp, pp=pp, ep=ep, etp=1 if a.experts else None, sequence_parallel=tp > 1)
    if a.layers % pp:  # an uneven split: the remainder goes to the last stage (the output layer's)
        base["last_stage_layers"] = a.layers - -(-a.layers // pp) * (pp - 1)
    return ParallelConfig(**base)


def _with_layout(config, parallel: ParallelConfig):
    models = config.models
    trainer = dataclasses.replace(models.policy_trainer, parallel=parallel)
    ref = dataclasses.replace(models.ref_policy, parallel=parallel)
    critic = dataclasses.replace(models.critic, parallel=parallel)
    return dataclasses.replace(
        config, models=dataclasses.replace(models, policy_trainer=trainer, ref_policy=ref, critic=critic)
    )


def describe(plan: MemoryPlan, max_model_len: int) -> list[str]:
    """The plan as report lines: the roles' parts, then every phase's total against the device."""
    t, e = plan.trainer, plan.engine
    lines = [
        f"memory per device ({plan.device_bytes / GiB:.0f} GiB): trainer weights {t.weights / GiB:.1f}, grads "
        f"{t.grads / GiB:.1f}, optimizer {t.optimizer / GiB:.1f}, activations {t.activations / GiB:.1f} GiB"
        + (f"; reference weights {plan.ref_weights / GiB:.1f} GiB" if plan.ref_weights else ""),
        f"  rollout engine: share {e.share / GiB:.1f} GiB (weights {e.weights / GiB:.1f}, working "
        f"{e.working / GiB:.1f}), KV cache {max(e.kv_tokens, 0):,} tokens at {e.kv_bytes_per_token / 1024:.0f} "
        f"KiB each ({max(e.kv_tokens, 0) / max_model_len:.1f} sequences of max_model_len)",
        "  phases: " + ", ".join(f"{p.name} {p.total / GiB:.1f}" for p in plan.phases) + " GiB",
    ]
    return lines + [f"  does not fit: {problem}" for problem in plan.problems]


def device_bytes(config) -> int:
    """``runtime_args.device_memory_gb``, else the local GPU's memory; 0 on a machine without one."""
    if config.runtime_args.device_memory_gb:
        return int(config.runtime_args.device_memory_gb * GiB)
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


def check_fits(config) -> list[str]:
    """Why ``config`` cannot fit its devices, with layouts that would (empty: it fits, or no GPU to check)."""
    memory = device_bytes(config)
    if not memory:
        return []
    plan = plan_memory(config, memory)
    if plan.fits:
        return []
    return describe(plan, config.models.policy.rollout.max_model_len) + remedies(config, memory)


def remedies(config, memory: int) -> list[str]:
    """Trainer layouts that fit ``memory`` per device, best first, or what else to change."""
    suggestions = suggest_layouts(config, memory)
    if not suggestions:
        trainer = config.models.policy_trainer
        changes = ["add devices"] + (
            ["set models.policy_trainer.recompute=full"] if trainer.recompute != "full" else []
        )
        knob = "max_token_in_packing" if trainer.max_token_in_packing else "micro_batch_size"
        return [f"  no trainer layout fits: {', '.join(changes)}, or lower models.policy_trainer.{knob}"]
    return ["  trainer layouts that fit these devices (models.policy_trainer.parallel), best first:"] + [
        f"    {layout_text(p)}: peak {peak / GiB:.1f} GiB" for p, peak in suggestions
    ]


def layout_text(parallel: ParallelConfig) -> str:
    """``{tp: 2, sequence_parallel: true}``: the fields that differ from a single device, as YAML."""
    fields = {k: v for k, v in dataclasses.asdict(parallel).items() if v is not None and v is not False}
    return "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in fields.items() if v is True or v != 1) + "}"
