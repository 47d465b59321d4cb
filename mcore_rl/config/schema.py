"""The run configuration: one YAML file in ChatLearn's shape (``runtime_args`` + ``models.*``), typed and checked
before any actor starts. Errors name the key and say how to fix it."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from converters.hf_io import HFCheckpoint
from converters.torch_dist import Reader, find_megatron
from mcore_rl.agent.envs import BUILTIN_ENVS
from mcore_rl.agent.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError
from mcore_rl.agent.tools import BUILTIN_TOOLS
from mcore_rl.algorithms.advantages import ESTIMATORS, TOKEN_ESTIMATORS
from mcore_rl.algorithms.grpo import PolicyLossConfig
from mcore_rl.config.loader import ConfigError, check_bounds, load_config
from mcore_rl.data.arithmetic import BUILTIN_SPLITS
from mcore_rl.loggers import LogConfig
from mcore_rl.planner.memory import Architecture, adaptable_linears
from mcore_rl.rewards.judge import PARSERS, JudgeError, load_template
from mcore_rl.rewards.user import RewardTerm, default_name
from mcore_rl.rollout.engine import MultiTurnConfig, RolloutConfig, vllm_lora_ranks
from mcore_rl.sync import SyncConfig
from mcore_rl.trainer.moe import MoEConfig
from mcore_rl.userfile import is_user_file
from mcore_rl.watchdog import WatchdogConfig
from models.lora import EXPERTS, MLA, LoRAConfig
from models.registry import BRIDGES, get_bridge
from parallel.config import ParallelConfig

BUILTIN_DATA = "builtin:arithmetic"
# The Megatron roles besides the policy trainer, in their placement order (each used only when configured).
SCORING_ROLES = ("ref_policy", "teacher", "critic", "reward_model")


@dataclass
class RuntimeArgs:
    exp_name: str = "run"
    output_dir: str = "runs/${runtime_args.exp_name}"
    # JSONL or Parquet of {"messages", "answer"} rows, or built in: "builtin:arithmetic" (one operation),
    # "builtin:word_problems" (multi-step, for the calculator tool)
    data_path: str = BUILTIN_DATA
    eval_data_path: str = BUILTIN_DATA  # the main eval set (eval/* metrics)
    # more eval sets by name, each as eval_data_path (eval/<name>/* metrics): {word_problems: builtin:word_problems}
    eval_sets: dict[str, str] = field(default_factory=dict)
    num_builtin_train: int = 2000
    num_builtin_eval: int = 100
    num_episode: int = 10
    sample_per_episode: int = 64  # prompts x num_inference_per_prompt
    train_global_batch_size: int = 32  # samples per optimizer step
    save_episode_interval: int = 5
    keep_checkpoints: int = 2  # the newest N complete checkpoints stay (0: all); SmolLM2's is 2.1 GB in fp32
    save_hf: bool = False  # each checkpoint also holds the policy as an HF model (hf/: vllm serve, transformers)
    eval_episode_interval: int = 5
    data_shuffle: bool = True
    seed: int = 1
    num_devices: int = 2  # GPUs, or logical devices declared to Ray on a CPU machine
    # Devices of the rollout engines. 0: colocated, every role on all num_devices devices, taking turns. N > 0:
    # disaggregated, the engines on the last N devices, the trainer and reference on the others.
    rollout_devices: int = 0
    # Devices of their own, after the rollout's (0: none). The reward model's ranks then score beside the rollout
    # instead of taking turns on the trainer's devices; a judge's engines (models.judge.load a model directory)
    # instead of sharing the policy engines' devices.
    reward_model_devices: int = 0
    judge_devices: int = 0
    # "sync": generate, train, sync weights, in turn. With rollout_devices > 0 also "one_step_off" (the next
    # episode's rollout overlaps this episode's training: samples are one policy version behind) and "async" (the
    # engines generate continuously into a buffer; each episode trains on the oldest ready samples).
    rollout_mode: Literal["sync", "one_step_off", "async"] = "sync"
    max_staleness: int = 1  # async: the most policy versions a trained sample's oldest token may lag (older: dropped)
    # async: generations in flight at a weight sync continue with the new weights (their later tokens carry the new
    # version); false: the sync waits until they finish
    partial_rollout: bool = True
    # GiB of one device, as GPUs are sold (H100: 80): the run stops before starting when an episode's phase cannot
    # fit it (mcore_rl.planner.memory); 0: the local GPU's, and no check on a CPU machine
    device_memory_gb: float = 0.0
    ray_address: str = ""  # an existing cluster ("auto" or host:port); empty: $RAY_ADDRESS, else start a local one
    log: LogConfig = field(default_factory=LogConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)  # reports a phase that hangs (mcore_rl.watchdog)

    @property
    def colocated(self) -> bool:
        return not self.rollout_devices

    @property
    def trainer_devices(self) -> int:
        """Devices of the trainer and the Megatron roles beside it (and the engines', when colocated)."""
        return self.num_devices - self.rollout_devices - self.reward_model_devices - self.judge_devices

    @property
    def engine_devices(self) -> int:
        """Devices of the rollout engines: the trainer's when colocated."""
        return self.rollout_devices or self.trainer_devices

    def world(self, role: str) -> int:
        """The ranks of a Megatron role: on the reward model's own devices where it has them, else the trainer's."""
        return (
            self.reward_model_devices if role == "reward_model" and self.reward_model_devices else self.trainer_devices
        )

    def devices(self, pool: str) -> range:
        """The devices (placement bundles) of ``pool``: ``trainer``, ``rollout`` (the trainer's when colocated),
        ``reward_model`` or ``judge`` (empty without devices of their own), laid out in that order."""
        sizes = {
            "trainer": self.trainer_devices,
            "rollout": self.rollout_devices,
            "reward_model": self.reward_model_devices,
            "judge": self.judge_devices,
        }
        if pool == "rollout" and self.colocated:
            return range(self.trainer_devices)
        first = 0
        for name, size in sizes.items():
            if name == pool:
                return range(first, first + size)
            first += size
        raise KeyError(pool)


@dataclass
class OptimizerSettings:
    lr: float = 1e-6
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"  # cosine/linear: lr to min_lr over the run
    min_lr: float = 0.0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    lr_warmup_steps: int = 0


@dataclass
class TrainerConfig:
    load: str = ""  # HF model directory
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 2
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    algorithm: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    # Per sample: grpo, dr_grpo, rloo, reinforce_pp_baseline; per token: reinforce_pp, gae (needs models.critic);
    # none: no task advantage, distillation alone (mcore_rl/algorithms/advantages.py)
    advantage_estimator: str = "grpo"
    # Per-token estimators: the k1 KL to the reference (log pi_old - log pi_ref) times this, subtracted from each
    # token's reward (REINFORCE++ and PPO's KL penalty; algorithm.kl_coef is the GRPO-style KL loss term instead)
    reward_kl_coef: float = 0.0
    gamma: float = 1.0  # per-token estimators: the discount over response tokens
    lam: float = 1.0  # gae: the GAE lambda
    # On-policy distillation (needs models.teacher): each response token's advantage gains this times
    # log pi_teacher - log pi_old (the negative reverse KL to the teacher on the student's own samples)
    distill_coef: float = 0.0
    # DAPO's overlong shaping: over the last overlong_buffer tokens before the rollout's max_new_tokens the reward
    # falls linearly, by overlong_penalty at the limit (0: off); overlong_filter: truncated samples leave the loss.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    overlong_filter: bool = False
    # Drop prompt groups with constant rewards and sample new prompts in their place (up to 3 refill rounds; then
    # the dropped groups, whose advantages are 0, fill what is still missing)
    dynamic_sampling: bool = False
    # GPU, colocated: weights, grads and optimizer state leave the device while the engines roll out
    offload: bool = True
    # > 0: pack samples (THD, no padding to the longest) into micro-batches of at most this many tokens, balanced
    # over data-parallel ranks; micro_batch_size is then unused. 0: padded micro-batches of micro_batch_size.
    max_token_in_packing: int = 0
    # Train and score each prompt's samples in one row holding the prompt once (responses see it through a block
    # attention mask; the LM head runs only where response tokens are predicted). Exact; saves the prompt's
    # repeats, so most when prompts are long next to responses. Not with MLA models or context parallelism.
    share_prompts: bool = False
    moe: MoEConfig = field(default_factory=MoEConfig)  # load balancing and router metrics (MoE models only)
    recompute: Literal["none", "full"] = (
        "none"  # "full": each layer keeps only its input and recomputes the rest in backward
    )
    # rank > 0: train LoRA adapters on the frozen model (models/lora.py); the reference is the model with the
    # adapters off (no models.ref_policy), and the engines get the weights merged with them
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # > 0: a model with multi-token-prediction layers (DeepSeek-V3's) trains them on the policy's samples with this
    # weight of their loss (models/mtp.py), so the drafter keeps up with the policy; 0: they stay the checkpoint's
    mtp_loss_coef: float = 0.0


@dataclass
class ReferenceConfig:
    load: str = "${models.policy_trainer.load}"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 2
    max_token_in_packing: int = "${models.policy_trainer.max_token_in_packing}"  # as the trainer's; 0: padded
    share_prompts: bool = "${models.policy_trainer.share_prompts}"


@dataclass
class TeacherConfig(ReferenceConfig):
    """On-policy distillation's teacher: scores the student's samples like the reference (its own layout)."""

    load: str = ""  # HF directory of a model with the policy's tokenizer; empty: no teacher


@dataclass
class CriticConfig:
    """PPO's value model: the policy's architecture with a value head, a Megatron role of its own."""

    # HF directory to start from, with the policy's tokenizer: a causal LM of its family (the policy's own) or a
    # reward model (*ForSequenceClassification, one label: its score head becomes the value head); empty: none
    load: str = ""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 2
    optimizer: OptimizerSettings = field(default_factory=lambda: OptimizerSettings(lr=1e-5))
    value_clip: float = 0.5  # PPO's value clip around the old values (0: plain squared error)
    warmup_episodes: int = 0  # the first episodes train the critic only; the policy waits for useful values
    max_token_in_packing: int = "${models.policy_trainer.max_token_in_packing}"
    share_prompts: bool = "${models.policy_trainer.share_prompts}"
    recompute: Literal["none", "full"] = (
        "none"  # as the policy trainer's; offload follows models.policy_trainer.offload
    )


@dataclass
class RewardModelConfig:
    """A reward model served as a model: a Megatron role scoring each whole conversation (re-rendered with its own
    tokenizer's chat template), one of the weighted rewards."""

    # HF directory of a one-label *ForSequenceClassification of a supported family (or its converted Megatron
    # checkpoint); empty: none
    load: str = ""
    name: str = "rm"  # its metrics: reward/<name>/mean
    weight: float = 1.0  # its weight in the sum with models.reward.fn and models.reward.terms
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 2
    max_token_in_packing: int = 0  # > 0: score in THD packs of at most this many tokens; 0: padded micro-batches
    share_prompts: ClassVar[bool] = False  # its rows are its own renderings, one per sample


@dataclass
class JudgeConfig:
    """A generative judge (mcore_rl/rewards/judge.py): a model prompted to grade each response, one of the weighted
    rewards."""

    # "policy": the policy's own rollout engines judge. An HF directory of a supported family: engines of its own
    # (on runtime_args.judge_devices, else beside the policy's engines, sleeping with them while the trainer
    # works), with its own tokenizer's chat template. Empty: no judge.
    load: str = ""
    name: str = "judge"  # its metrics: reward/<name>/mean, reward/<name>_failures
    weight: float = 1.0  # its weight in the sum with the other rewards
    # The judge's user message: text with {response}, optionally {question} and {answer}; or a file holding it
    template: str = ""
    # The verdict -> a number: "score_tag" (<score>x</score>), "yes_no", or path/to/file.py:function (verdict text)
    # -> number or None (unreadable), run in an actor of its own, each call within models.reward.timeout_s
    parser: str = "score_tag"
    max_new_tokens: int = 64  # a verdict's length (greedy)
    timeout_s: float = 120.0  # a batch of verdicts past it scores 0, counted as failures
    # A judge's own engines (load a model directory): each over tensor_parallel_size devices, with its context
    # length and, on CUDA, its share of each device's memory
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.3

    ENGINE_KEYS: ClassVar[tuple[str, ...]] = ("tensor_parallel_size", "max_model_len", "gpu_memory_utilization")

    @property
    def own_engines(self) -> bool:
        return bool(self.load) and self.load != "policy"

    def engine_config(self, policy: RolloutConfig) -> RolloutConfig:
        """The judge engines' settings: the policy engines' (dtype, CPU KV cache, threads) with the judge's size.
        Its weights never change, so a sleeping engine keeps them in host memory (sleep level 1)."""
        return dataclasses.replace(
            policy, **{k: getattr(self, k) for k in self.ENGINE_KEYS}, sleep_level=1, return_routed_experts=False,
            load_tokenizer=True, multi_turn=MultiTurnConfig(),
        )  # fmt: skip


@dataclass
class PolicyConfig:
    load: str = "${models.policy_trainer.load}"
    num_inference_per_prompt: int = 8
    max_prompt_tokens: int = 256
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)


@dataclass
class RewardConfig:
    # "math", "path/to/file.py" or "path/to/file.py:function" (returning a number, or {"score": x, <component>: y});
    # with terms, "" leaves it out
    fn: str = "math"
    weight: float = 1.0  # fn's weight in the sum with terms
    # Further weighted rewards, summed with fn's (single-turn): [{name, fn, weight}]; each logged as reward/<name>/mean
    terms: list[RewardTerm] = field(default_factory=list)
    num_actors: int = 1  # single-turn: the reward actors, each reserving num_cpus
    num_cpus: float = 1.0
    timeout_s: float = 30.0  # a sample's reward call past it is stopped (its actor replaced): reward 0, reward/errors
    # Single-turn: score each prompt group as soon as its completions are done, beside the rollout of the others
    # (false: after the whole batch); time/reward_wait is what is left to wait for once the rollout has finished
    overlap_rollout: bool = True
    # Multi-turn rollouts (limits: models.policy.rollout.multi_turn), when an environment or tools are given.
    # "answer": fn scores the final answer (the default with tools); "python": a code interpreter (sandboxed
    # ```python blocks); or "path/to/file.py:Class" with reset(row) -> messages, step(message) -> (messages,
    # reward, done).
    env: str = ""
    tools: list[str] = field(default_factory=list)  # "calculator", "python", "path/to/file.py:name"
    # Environment and tool actors reserve no CPUs (they mostly wait); their numbers bound the work at once.
    env_actors: int = 1  # each hosts many trajectories' environments
    env_timeout_s: float = 60.0  # an environment step past it ends its trajectory (stop reason env_error)
    tool_actors: int = 4  # tool calls running at once; one actor each
    tool_timeout_s: float = 10.0  # a call past it is stopped; the policy reads a timeout error
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # the python tool's and environment's limits

    @property
    def multi_turn(self) -> bool:
        return bool(self.env or self.tools)

    @property
    def weighted_terms(self) -> list[tuple[str, RewardTerm]]:
        """(config key, term) of every reward function a single-turn sample's reward sums: fn's, then the terms'."""
        first = [("models.reward.fn", RewardTerm(default_name(self.fn), self.fn, self.weight))] if self.fn else []
        return first + [(f"models.reward.terms[{i}].fn", term) for i, term in enumerate(self.terms)]

    @property
    def environment(self) -> str:
        return self.env or "answer"

    @property
    def runs_code(self) -> bool:
        """The policy's code runs in the sandbox (the python tool or environment)."""
        return self.environment == "python" or "python" in self.tools


@dataclass
class ModelsConfig:
    policy_trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ref_policy: ReferenceConfig = field(default_factory=ReferenceConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    @property
    def needs_reference(self) -> bool:
        """Whether the loss or the reward reads the reference policy's log-probs: from models.ref_policy, or from
        the policy trainer with its LoRA adapters off."""
        return bool(self.policy_trainer.algorithm.kl_coef or self.policy_trainer.reward_kl_coef)

    def uses(self, role: str) -> bool:
        """Whether the run starts the Megatron role ``role`` (``policy_trainer`` or one of :data:`SCORING_ROLES`)."""
        return {
            "policy_trainer": True,
            "ref_policy": self.needs_reference and not self.policy_trainer.lora.rank,
            "teacher": bool(self.teacher.load),
            "critic": bool(self.critic.load),
            "reward_model": bool(self.reward_model.load),
        }[role]

    @property
    def megatron_roles(self) -> list[str]:
        """The Megatron roles the run starts."""
        return [role for role in ("policy_trainer", *SCORING_ROLES) if self.uses(role)]

    @property
    def trained_roles(self) -> list[str]:
        """The Megatron roles that train: the policy, and PPO's critic where there is one."""
        return [role for role in ("policy_trainer", "critic") if self.uses(role)]

    @property
    def checked_roles(self) -> list[str]:
        """The Megatron roles whose sections are validated: those the run starts, and the reference always (its
        settings follow the trainer's unless given, and a run that adds a KL term later should not fail then)."""
        return [r for r in ("policy_trainer", *SCORING_ROLES) if self.uses(r) or r == "ref_policy"]


@dataclass
class RunConfig:
    runtime_args: RuntimeArgs = field(default_factory=RuntimeArgs)
    models: ModelsConfig = field(default_factory=ModelsConfig)

    def validate(self) -> None:
        """Everything that can be checked without starting an actor; raises ConfigError naming the key."""
        try:
            self._validate()
        except ConfigError:
            raise
        except ValueError as err:  # a component's own check (it names its field)
            raise ConfigError(str(err)) from None

    def _validate(self) -> None:
        """Each section's checks, in an order where a later one may rely on an earlier."""
        self._validate_counts()
        self._validate_reward_terms()
        if self.models.reward.multi_turn:
            self._validate_multi_turn()
        self._validate_packing()
        self._validate_placement()
        self._validate_layouts()
        self._validate_training()
        self._validate_models()
        self._validate_lora()
        self._validate_roles()
        self._validate_data()

    @property
    def _role_keys(self) -> list[str]:
        """The Megatron roles' sections."""
        return [f"models.{role}" for role in self.models.checked_roles]

    @property
    def _engine_keys(self) -> list[str]:
        """The sections of the models engines serve: the policy, and a judge's with engines of its own."""
        return ["models.policy"] + (["models.judge"] if self.models.judge.own_engines else [])

    def _validate_counts(self) -> None:
        """Counts, batch divisibility, keys set by others, lengths."""
        rt, m = self.runtime_args, self.models
        rt.log.validate()
        rt.watchdog.validate()
        positive = {
            "runtime_args.num_episode": rt.num_episode,
            "runtime_args.sample_per_episode": rt.sample_per_episode,
            "runtime_args.train_global_batch_size": rt.train_global_batch_size,
            "runtime_args.num_devices": rt.num_devices,
            "models.policy_trainer.micro_batch_size": m.policy_trainer.micro_batch_size,
            "models.policy.num_inference_per_prompt": m.policy.num_inference_per_prompt,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{key}={value}: expected at least 1")
        n = m.policy.num_inference_per_prompt
        if rt.sample_per_episode % n:
            raise ConfigError(
                f"runtime_args.sample_per_episode={rt.sample_per_episode} is not a multiple of "
                f"models.policy.num_inference_per_prompt={n}: whole prompt groups are sampled"
            )
        if rt.sample_per_episode % rt.train_global_batch_size:
            raise ConfigError(
                f"runtime_args.sample_per_episode={rt.sample_per_episode} is not a multiple of "
                f"runtime_args.train_global_batch_size={rt.train_global_batch_size}"
            )
        if m.policy.rollout.return_routed_experts:
            raise ConfigError(
                "models.policy.rollout.return_routed_experts: set by models.policy_trainer.moe.routing_replay; "
                "remove it (set routing_replay: true to replay the rollout's routing)"
            )
        if m.policy.rollout.lora_rank:
            raise ConfigError(
                "models.policy.rollout.lora_rank: set from models.policy_trainer.lora.rank when "
                "models.policy.sync.lora is 'adapter'; remove it"
            )
        train = m.policy.rollout.train
        if train.n not in (1, n):
            raise ConfigError(
                f"models.policy.rollout.train.n={train.n}: samples per prompt are set by "
                f"models.policy.num_inference_per_prompt={n}; remove rollout.train.n"
            )
        longest = m.policy.max_prompt_tokens + max(train.max_new_tokens, m.policy.rollout.eval.max_new_tokens)
        if longest > m.policy.rollout.max_model_len:
            raise ConfigError(
                f"models.policy.max_prompt_tokens + max_new_tokens = {longest} exceeds "
                f"models.policy.rollout.max_model_len={m.policy.rollout.max_model_len}; raise it or shorten either"
            )
        check_bounds("models.reward", m.reward, ("timeout_s",), 0, "a positive number of seconds", strict=True)

    def _validate_packing(self) -> None:
        """Packing budgets that hold the longest sample."""
        m = self.models
        what = (
            "a multi-turn trajectory's max_total_tokens"
            if m.reward.multi_turn
            else "max_prompt_tokens + max_new_tokens"
        )
        for role in m.checked_roles:
            packing = getattr(m, role).max_token_in_packing
            if packing and packing < self.longest_sample:
                raise ConfigError(
                    f"models.{role}.max_token_in_packing={packing} is below the longest sample ({self.longest_sample} "
                    f"tokens: {what}); raise it, or set 0 for padded micro-batches"
                )

    def _validate_training(self) -> None:
        """Recompute, memory, the LR schedule, the loss, the estimator and its shaping, the engines' settings."""
        rt, m = self.runtime_args, self.models
        check_bounds("runtime_args", rt, ("device_memory_gb",), 0, ">= 0 (0: detect)")
        m.policy_trainer.algorithm.validate("models.policy_trainer.algorithm")
        self._validate_estimator()
        self._validate_overlong()
        if m.policy_trainer.advantage_estimator == "rloo" and m.policy.num_inference_per_prompt < 2:
            raise ConfigError(
                "models.policy_trainer.advantage_estimator='rloo' needs models.policy.num_inference_per_prompt >= 2 "
                "(the baseline is the other samples of the prompt)"
            )
        m.policy.rollout.validate("models.policy.rollout")
        m.policy.sync.validate("models.policy.sync")

    def _validate_models(self) -> None:
        """Model directories, the engines' HF weights, each role's family and layout, MoE, MTP, drafting."""
        m = self.models
        for key in self.model_keys:
            _check_model_dir(key, self._get(key))
        engines = self._engine_keys
        for key in engines:
            if find_megatron(self._get(key).load):
                raise ConfigError(
                    f"{key}.load={self._get(key).load!r}: a Megatron checkpoint, but vLLM engines load HF weights; "
                    "set it to the HF directory (the Megatron roles may load the Megatron checkpoint)"
                )
        roles = self._role_keys
        for key in [*roles, *engines[1:]]:
            role = self._get(key)
            try:
                bridge = get_bridge(role.load)
            except ValueError as err:  # an architecture no family declares
                raise ConfigError(f"{key}.load={role.load!r}: {err}") from None
            try:
                if key in roles:
                    bridge.validate_layout(role.parallel)
            except ValueError as err:
                raise ConfigError(f"{key}.parallel: {err}") from None
        m.policy_trainer.moe.validate("models.policy_trainer.moe", get_bridge(m.policy_trainer.load))
        self._check_mtp()
        self._check_speculative()

    def _validate_lora(self) -> None:
        """LoRA's targets against the model, its router and expert-TP rules, adapter-only sync."""
        m = self.models
        lora = m.policy_trainer.lora
        lora.validate()
        if lora.rank:
            a = Architecture.from_bridge(get_bridge(m.policy_trainer.load))
            present = set().union(*(adaptable_linears(a, moe) for moe in a.moe_layers))
            if missing := sorted(set(lora.targets) - present):
                raise ConfigError(
                    f"models.policy_trainer.lora.targets: {missing} match no linear of {m.policy_trainer.load!r} "
                    "(multi-latent attention has its own projections instead of linear_qkv; an MoE layer's "
                    "linear_fc1 and linear_fc2 are its shared experts', its routed experts' are experts.linear_fc1 "
                    f"and experts.linear_fc2); adapt {sorted(present)}"
                )
            if lora.train_router and not a.experts:
                raise ConfigError(
                    f"models.policy_trainer.lora.train_router: {m.policy_trainer.load!r} has no MoE router; set it false"
                )
            if m.policy_trainer.moe.expert_bias_update_rate and not lora.train_router:
                raise ConfigError(
                    "models.policy_trainer.moe.expert_bias_update_rate: moves the routers' expert bias, which LoRA keeps "
                    "frozen with the routers; set models.policy_trainer.lora.train_router: true, or the rate to 0"
                )
            etp = m.policy_trainer.parallel.expert_tp
            if etp > 1 and (experts := sorted(t for t in lora.targets if t.startswith("experts."))):
                raise ConfigError(
                    f"models.policy_trainer.lora.targets: {experts} need expert tensor parallelism 1 (each expert's "
                    f"adapter whole on its rank), here {etp}; set models.policy_trainer.parallel.etp: 1"
                )
        self._check_adapter_sync()

    def _validate_roles(self) -> None:
        """Which roles take a reward model, shared-prompt rows per role."""
        rt, m = self.runtime_args, self.models
        n = m.policy.num_inference_per_prompt
        roles, engines = self._role_keys, self._engine_keys
        if m.uses("reward_model"):
            path, bridge = m.reward_model.load, get_bridge(m.reward_model.load)
            if not bridge.value_model:
                names = sorted(b.value_architecture for b in BRIDGES.values() if b.value_architecture)
                raise ConfigError(
                    f"models.reward_model.load={path!r}: {bridge.architecture} is no reward model; expected "
                    f"a one-label sequence classifier, one of {names}"
                )
        for key in [*roles, *engines]:
            if key not in ("models.critic", "models.reward_model") and get_bridge(self._get(key).load).value_model:
                raise ConfigError(
                    f"{key}.load={self._get(key).load!r}: a reward model (a score head, no LM head); it can start "
                    "models.critic only, this role needs a causal LM"
                )
        for key in roles:
            role = self._get(key)
            mla = role.share_prompts and get_bridge(role.load).multi_latent_attention
            if role.share_prompts and (mla or role.parallel.cp > 1):
                raise ConfigError(
                    f"{key}.share_prompts: shared-prompt rows need whole rows per rank (parallel.cp="
                    f"{role.parallel.cp}) and rotary embeddings outside attention ({role.load!r} uses MLA: "
                    f"{mla}); set it to false"
                )
        for role in m.trained_roles:
            groups, dp = rt.train_global_batch_size // n, getattr(m, role).parallel.dp(rt.trainer_devices)
            if getattr(m, role).share_prompts and groups < dp:
                raise ConfigError(
                    f"models.{role}.share_prompts: a step's {groups} prompt groups (train_global_batch_size / "
                    f"num_inference_per_prompt) cannot give each of the {dp} data-parallel ranks a whole group; "
                    "raise runtime_args.train_global_batch_size or set share_prompts to false"
                )
        if m.policy_trainer.share_prompts and m.policy_trainer.moe.routing_replay:
            raise ConfigError(
                "models.policy_trainer.share_prompts: routing replay takes per-sample rows; set share_prompts or "
                "moe.routing_replay to false"
            )

    def _validate_data(self) -> None:
        """The train and eval data files."""
        rt = self.runtime_args
        paths = {"runtime_args.data_path": rt.data_path, "runtime_args.eval_data_path": rt.eval_data_path}
        for name, path in rt.eval_sets.items():
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError(f"runtime_args.eval_sets.{name}: name a set with letters, digits, '_', '.' or '-'")
            paths[f"runtime_args.eval_sets.{name}"] = path
        for key, path in paths.items():
            if path not in BUILTIN_SPLITS and not Path(path).is_file():
                raise ConfigError(f"{key}={path!r}: file not found (or use one of {list(BUILTIN_SPLITS)})")

    @property
    def longest_sample(self) -> int:
        """Tokens of the longest sample training can get: prompt and response, or a whole multi-turn trajectory."""
        policy = self.models.policy
        if self.models.reward.multi_turn:
            return policy.rollout.multi_turn.total_tokens(policy.rollout.max_model_len)
        return policy.max_prompt_tokens + policy.rollout.train.max_new_tokens

    def check_files(self) -> None:
        """The model directories' files: weights all there and whole (headers and sizes; no tensor is read), and the
        tokenizers the teacher, critic and reward model need. A run checks this before it writes anything; a dry run
        needs no weights or tokenizers, only config.json."""
        self._check_weights()
        self._validate_vocabularies()
        if self.models.uses("reward_model"):
            self._check_chat_template("reward_model")
        if self.models.judge.own_engines:
            self._check_chat_template("judge")

    def _check_weights(self) -> None:
        checked = set()
        for key in self.model_keys:
            path = self._get(key)
            if path in checked:  # the same directory, checked under the first key that names it
                continue
            checked.add(path)
            megatron = find_megatron(path)
            try:
                if megatron is None:
                    HFCheckpoint(path)  # opening it checks every safetensors file
                    continue
                missing = Reader(megatron).missing_data()
            except (ValueError, OSError) as err:
                raise ConfigError(f"{key}={path!r}: {err}") from None
            if missing:
                raise ConfigError(f"{key}={path!r}: incomplete Megatron checkpoint: " + "; ".join(missing))

    @property
    def model_keys(self) -> list[str]:
        """The keys of the model directories the run loads: every Megatron role's, the rollout engines', and a
        judge's own."""
        judge = ["models.judge.load"] if self.models.judge.own_engines else []
        return [f"models.{role}.load" for role in self.models.checked_roles] + ["models.policy.load", *judge]

    def _get(self, dotted: str):
        node = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node

    def _validate_placement(self) -> None:
        rt, m = self.runtime_args, self.models
        pools = {"rollout_devices": rt.rollout_devices, "reward_model_devices": rt.reward_model_devices}
        pools["judge_devices"] = rt.judge_devices
        if min(pools.values()) < 0 or rt.trainer_devices < 1:
            given = ", ".join(f"{k}={v}" for k, v in pools.items() if v)
            raise ConfigError(
                f"runtime_args.{given}: expected 0 (shared) or more, leaving the trainer at least one of "
                f"num_devices={rt.num_devices}"
            )
        for key, role, what in (
            ("reward_model_devices", "reward_model", "models.reward_model.load"),
            ("judge_devices", "judge", "models.judge.load (a model directory)"),
        ):
            if pools[key] and not (m.uses(role) if role == "reward_model" else m.judge.load):
                raise ConfigError(f"runtime_args.{key}={pools[key]}: devices for a role the run has not; set {what}")
        if rt.rollout_mode != "sync" and rt.colocated:
            raise ConfigError(
                f"runtime_args.rollout_mode={rt.rollout_mode!r} overlaps rollout with training, which colocated roles "
                "cannot (they take turns on every device); give the engines devices of their own with "
                "runtime_args.rollout_devices > 0, or set rollout_mode: sync"
            )
        if rt.rollout_mode == "async" and rt.max_staleness < 1:
            raise ConfigError(
                f"runtime_args.max_staleness={rt.max_staleness}: async rollout needs at least 1 (samples generated "
                "while the trainer trains are a version behind); for on-policy batches use rollout_mode: sync"
            )
        if rt.rollout_mode == "async" and m.policy_trainer.moe.routing_replay and rt.partial_rollout:
            raise ConfigError(
                "runtime_args.partial_rollout: a partial rollout recomputes its context with new weights, so the "
                "routing of its earlier tokens is not the routing that sampled them; set partial_rollout: false "
                "or models.policy_trainer.moe.routing_replay: false"
            )

    def _validate_estimator(self) -> None:
        m, prefix = self.models, "models.policy_trainer"
        trainer = m.policy_trainer
        estimator = trainer.advantage_estimator
        known = sorted(ESTIMATORS) + list(TOKEN_ESTIMATORS) + ["none"]
        if estimator not in known:
            raise ConfigError(f"{prefix}.advantage_estimator={estimator!r}: expected one of {known}")
        if estimator == "rloo" and m.policy.num_inference_per_prompt < 2:
            raise ConfigError(
                f"{prefix}.advantage_estimator='rloo' needs models.policy.num_inference_per_prompt >= 2 (the "
                "baseline is the other samples of the prompt)"
            )
        check_bounds(prefix, trainer, ("reward_kl_coef", "distill_coef"), 0, ">= 0 (0: off)")
        for key in ("gamma", "lam"):
            if not 0 <= getattr(trainer, key) <= 1:
                raise ConfigError(f"{prefix}.{key}={getattr(trainer, key)}: expected a number in [0, 1]")
        if trainer.reward_kl_coef and estimator not in TOKEN_ESTIMATORS:
            raise ConfigError(
                f"{prefix}.reward_kl_coef={trainer.reward_kl_coef}: a KL penalty in the per-token reward needs a "
                f"per-token estimator ({list(TOKEN_ESTIMATORS)}); with {estimator!r} use "
                f"{prefix}.algorithm.kl_coef (a KL term in the loss) instead"
            )
        if (estimator == "gae") != bool(m.critic.load):
            raise ConfigError(
                f"{prefix}.advantage_estimator='gae' needs PPO's critic: set models.critic.load to the policy's HF "
                "directory (the value model starts from it)"
                if estimator == "gae"
                else f"models.critic.load={m.critic.load!r}: only {prefix}.advantage_estimator='gae' uses a critic; "
                "set the estimator to gae or remove models.critic"
            )
        if bool(trainer.distill_coef) != bool(m.teacher.load):
            raise ConfigError(
                f"{prefix}.distill_coef={trainer.distill_coef} needs a teacher: set models.teacher.load to its HF "
                "directory"
                if trainer.distill_coef
                else f"models.teacher.load={m.teacher.load!r}: the teacher is used by on-policy distillation only; "
                f"set {prefix}.distill_coef > 0 or remove models.teacher"
            )
        if estimator == "none" and not trainer.distill_coef:
            raise ConfigError(
                f"{prefix}.advantage_estimator='none' trains on the teacher's signal alone: set "
                f"{prefix}.distill_coef > 0 and models.teacher.load, or choose an estimator"
            )
        critic = m.critic
        if critic.load:
            if critic.value_clip < 0 or critic.micro_batch_size < 1:
                raise ConfigError("models.critic.value_clip: expected >= 0; models.critic.micro_batch_size: >= 1")
            if not 0 <= critic.warmup_episodes < self.runtime_args.num_episode:
                raise ConfigError(
                    f"models.critic.warmup_episodes={critic.warmup_episodes}: expected 0 up to runtime_args."
                    f"num_episode - 1 = {self.runtime_args.num_episode - 1} (the policy trains after them)"
                )

    def _validate_vocabularies(self) -> None:
        """The teacher and the critic read the policy's token ids: their tokenizers must be the policy's."""
        from transformers import AutoTokenizer

        m = self.models
        policy = None
        for role in ("teacher", "critic"):
            path = getattr(m, role).load
            if not m.uses(role) or path == m.policy.load:
                continue
            policy = policy or AutoTokenizer.from_pretrained(m.policy.load).get_vocab()
            try:
                theirs = AutoTokenizer.from_pretrained(path).get_vocab()
            except (OSError, ValueError) as err:
                raise ConfigError(f"models.{role}.load={path!r}: its tokenizer does not load ({err})") from None
            if theirs != policy:
                differ = sorted(set(theirs.items()) ^ set(policy.items()), key=str)[:3]
                raise ConfigError(
                    f"models.{role}.load={path!r}: its tokenizer is not the policy's ({len(theirs)} tokens against "
                    f"{len(policy)}; differing entries such as {differ}); the {role} must score the policy's token "
                    "ids, so it needs the same vocabulary"
                )

    def _validate_reward_terms(self) -> None:
        reward = self.models.reward
        if reward.terms and reward.multi_turn:
            raise ConfigError(
                "models.reward.terms: weighted rewards score single-turn samples; a multi-turn run's reward is its "
                "environment's (models.reward.env, with models.reward.fn); remove the terms"
            )
        model = self.models.reward_model
        if model.load and reward.multi_turn:
            raise ConfigError(
                "models.reward_model: a reward model scores single-turn samples; a multi-turn run's reward is its "
                "environment's (models.reward.env, with models.reward.fn); remove it"
            )
        judge = self.models.judge
        if not reward.fn and not reward.terms and not model.load and not judge.load:
            raise ConfigError(
                "models.reward.fn is empty, and neither models.reward.terms, models.reward_model nor models.judge is "
                "given: give a reward"
            )
        if not reward.terms and not model.load and not judge.load and reward.weight != 1.0:
            raise ConfigError(
                f"models.reward.weight={reward.weight}: weighs models.reward.fn in a sum with models.reward.terms; "
                "with fn alone it changes nothing but the scale (set it in the function), so remove it"
            )
        seen = {}
        for key, term in reward.weighted_terms:
            where = key.rsplit(".", 1)[0]
            if not term.fn:
                raise ConfigError(f"{key}: no reward function; expected 'math' or path/to/file.py[:function]")
            if not term.name:
                raise ConfigError(f"{where}.name: empty; name the reward (its metrics are reward/<name>/mean)")
            if not math.isfinite(term.weight):
                raise ConfigError(f"{where}.weight={term.weight}: expected a finite number")
            if term.name in seen:
                raise ConfigError(
                    f"{where}.name={term.name!r} is also {seen[term.name]}'s name; give each reward its own "
                    "(reward/<name>/mean would mix them)"
                )
            seen[term.name] = where
        if model.load:
            if model.name in seen:
                raise ConfigError(
                    f"models.reward_model.name={model.name!r} is also {seen[model.name]}'s name; give each reward "
                    "its own"
                )
            if not math.isfinite(model.weight):
                raise ConfigError(f"models.reward_model.weight={model.weight}: expected a finite number")
            if model.micro_batch_size < 1:
                raise ConfigError(f"models.reward_model.micro_batch_size={model.micro_batch_size}: expected >= 1")
            seen[model.name] = "models.reward_model"
        if judge.load:
            self._validate_judge(seen)

    def _validate_judge(self, names: dict[str, str]) -> None:
        judge, rt = self.models.judge, self.runtime_args
        if self.models.reward.multi_turn:
            raise ConfigError("models.judge: a judge grades single-turn responses; remove it from a multi-turn run")
        if not judge.own_engines:
            if rt.rollout_mode == "async":
                raise ConfigError(
                    "models.judge.load='policy' with runtime_args.rollout_mode='async': the engines' weights change "
                    "while groups are judged; give the judge engines of its own (load a model directory) or use "
                    "rollout_mode sync or one_step_off"
                )
            if changed := ["runtime_args.judge_devices"] * bool(rt.judge_devices) + [
                f"models.judge.{k}" for k in judge.ENGINE_KEYS if getattr(judge, k) != getattr(JudgeConfig, k)
            ]:
                raise ConfigError(
                    f"{', '.join(changed)}: size a judge's own engines, but models.judge.load='policy' judges on the "
                    "policy's engines; remove them, or load the judge from a model directory"
                )
        if judge.name in names:
            raise ConfigError(f"models.judge.name={judge.name!r} is also {names[judge.name]}'s name; give it its own")
        if judge.parser not in PARSERS and not is_user_file(judge.parser):
            raise ConfigError(
                f"models.judge.parser={judge.parser!r}: expected one of {sorted(PARSERS)} or an existing "
                "path/to/file.py:function"
            )
        if not math.isfinite(judge.weight) or judge.timeout_s <= 0 or judge.max_new_tokens < 1:
            raise ConfigError(
                "models.judge: expected a finite weight, timeout_s > 0 and max_new_tokens >= 1 (got "
                f"{judge.weight}, {judge.timeout_s}, {judge.max_new_tokens})"
            )
        try:
            load_template(judge.template)
        except JudgeError as err:
            raise ConfigError(str(err)) from None
        if judge.own_engines:
            if not 0 < judge.gpu_memory_utilization < 1 or judge.max_new_tokens >= judge.max_model_len:
                raise ConfigError(
                    f"models.judge: expected 0 < gpu_memory_utilization < 1 and max_new_tokens < max_model_len (got "
                    f"{judge.gpu_memory_utilization}, {judge.max_new_tokens}, {judge.max_model_len})"
                )
            policy = self.models.policy.rollout.gpu_memory_utilization
            if not rt.judge_devices and policy + judge.gpu_memory_utilization > 0.95:
                raise ConfigError(
                    f"models.judge.gpu_memory_utilization={judge.gpu_memory_utilization} + models.policy.rollout."
                    f"gpu_memory_utilization={policy} > 0.95: the judge's engines share the policy engines' "
                    "devices on CUDA; lower them or give the judge runtime_args.judge_devices"
                )
            engines = rt.devices("judge") or rt.devices("rollout")
            if len(engines) % judge.tensor_parallel_size:
                where = "runtime_args.judge_devices" if rt.judge_devices else "the rollout engines' devices"
                raise ConfigError(
                    f"models.judge.tensor_parallel_size={judge.tensor_parallel_size} does not divide {where} "
                    f"({len(engines)}): each judge engine takes tensor_parallel_size devices"
                )

    def _check_chat_template(self, role: str) -> None:
        """The reward model and a judge of its own render what they read with their own tokenizer's chat
        template."""
        from transformers import AutoTokenizer

        path = getattr(self.models, role).load
        try:
            template = AutoTokenizer.from_pretrained(path).chat_template
        except (OSError, ValueError) as err:
            raise ConfigError(f"models.{role}.load={path!r}: its tokenizer does not load ({err})") from None
        if not template:
            raise ConfigError(
                f"models.{role}.load={path!r}: its tokenizer has no chat template, which what it reads is rendered "
                "with; add one (tokenizer_config.json or chat_template.jinja)"
            )

    def _validate_overlong(self) -> None:
        trainer, rollout = self.models.policy_trainer, self.models.policy.rollout
        prefix = "models.policy_trainer"
        if trainer.overlong_buffer < 0 or trainer.overlong_penalty < 0:
            raise ConfigError(f"{prefix}.overlong_buffer and {prefix}.overlong_penalty: expected >= 0 (buffer 0: off)")
        if not trainer.overlong_buffer:
            return
        if self.models.reward.multi_turn:
            raise ConfigError(
                f"{prefix}.overlong_buffer={trainer.overlong_buffer}: overlong shaping is measured against one "
                "response's max_new_tokens, and a multi-turn trajectory has one per turn; set it to 0"
            )
        if trainer.overlong_buffer >= rollout.train.max_new_tokens:
            raise ConfigError(
                f"{prefix}.overlong_buffer={trainer.overlong_buffer}: expected fewer than "
                f"models.policy.rollout.train.max_new_tokens={rollout.train.max_new_tokens} (the penalty starts "
                "that many tokens before the limit)"
            )

    def _validate_multi_turn(self) -> None:
        m = self.models
        reward, limits = m.reward, m.policy.rollout.multi_turn
        check_bounds("models.reward", reward, ("env_actors", "tool_actors"), 1, "at least 1")
        check_bounds(
            "models.reward", reward, ("env_timeout_s", "tool_timeout_s"), 0, "a positive number of seconds", True
        )
        reward.sandbox.validate("models.reward.sandbox")
        if reward.runs_code:
            try:
                Sandbox.start(reward.sandbox)  # logs the kernel layers that will confine the policy's code
            except SandboxUnavailableError as err:
                raise ConfigError(f"models.reward: {err}") from None
        for key, spec, builtins in [("models.reward.env", reward.environment, BUILTIN_ENVS)] + [
            (f"models.reward.tools[{i}]", tool, BUILTIN_TOOLS) for i, tool in enumerate(reward.tools)
        ]:
            if spec not in builtins and not is_user_file(spec):
                raise ConfigError(
                    f"{key}={spec!r}: expected one of {list(builtins)} or an existing path/to/file.py[:name]"
                )
        total = limits.total_tokens(m.policy.rollout.max_model_len)
        if total <= m.policy.max_prompt_tokens:
            raise ConfigError(
                f"models.policy.rollout.multi_turn.max_total_tokens={total} leaves no room after a prompt of "
                f"models.policy.max_prompt_tokens={m.policy.max_prompt_tokens}; raise it"
            )
        if m.policy_trainer.moe.routing_replay:
            raise ConfigError(
                "models.policy_trainer.moe.routing_replay: multi-turn trajectories are sampled turn by turn, with "
                "no routing of their observation tokens to replay; set it to false"
            )

    def _check_adapter_sync(self) -> None:
        """``models.policy.sync.lora: adapter``: the engines serve the policy's adapters with vLLM's LoRA."""
        m = self.models
        lora, key = m.policy_trainer.lora, "models.policy.sync.lora='adapter'"
        if m.policy.sync.lora != "adapter":
            return
        if not lora.rank:
            raise ConfigError(
                f"{key} syncs LoRA adapters, but models.policy_trainer.lora.rank is 0; set sync.lora: merged"
            )
        if experts := sorted(t for t in lora.targets if t.startswith(EXPERTS)):
            raise ConfigError(
                f"{key}: the routed experts' adapters ({experts}) have no PEFT form for vLLM's LoRA; sync them "
                "merged (models.policy.sync.lora: merged) or drop them from models.policy_trainer.lora.targets"
            )
        if mla := sorted(set(lora.targets) & set(MLA)):
            raise ConfigError(
                f"{key}: multi-latent attention's adapters ({mla}) sync merged for now (the engines' LoRA over MLA "
                "is not verified yet); set models.policy.sync.lora: merged"
            )
        if lora.train_router:
            raise ConfigError(
                f"{key}: the routers train beside the adapters (models.policy_trainer.lora.train_router), and vLLM's "
                "LoRA serves adapters alone; sync them merged (models.policy.sync.lora: merged)"
            )
        if lora.rank > max(ranks := vllm_lora_ranks()):
            raise ConfigError(
                f"{key}: vLLM serves LoRA ranks up to {max(ranks)}, models.policy_trainer.lora.rank is {lora.rank}"
            )
        if m.policy.rollout.sleep_level != 1:
            raise ConfigError(
                f"{key}: the engines keep their base weights across sleeps (the sync sends adapters only); set "
                "models.policy.rollout.sleep_level: 1"
            )

    def _check_speculative(self) -> None:
        """``models.policy.rollout.speculative_tokens``: the engines draft with the model's MTP layers."""
        m = self.models
        tokens, key = m.policy.rollout.speculative_tokens, "models.policy.rollout.speculative_tokens"
        if not tokens:
            return
        bridge = get_bridge(m.policy.load)
        if not bridge.num_mtp_layers:
            raise ConfigError(
                f"{key}={tokens}: {m.policy.load!r} ({bridge.architecture}) has no multi-token-prediction layers "
                "(num_nextn_predict_layers) to draft with; set it to 0"
            )
        if m.policy.sync.lora == "adapter":
            raise ConfigError(
                f"{key}={tokens}: not with models.policy.sync.lora='adapter' (vLLM's LoRA beside an MTP drafter is "
                "untested here); sync the adapters merged or set it to 0"
            )

    def _check_mtp(self) -> None:
        trainer = self.models.policy_trainer
        coef = trainer.mtp_loss_coef
        if not coef:
            return
        key = "models.policy_trainer.mtp_loss_coef"
        if not math.isfinite(coef) or coef < 0:
            raise ConfigError(f"{key}={coef}: expected a finite weight >= 0")
        bridge = get_bridge(trainer.load)
        if not bridge.num_mtp_layers:
            raise ConfigError(
                f"{key}={coef}: {trainer.load!r} ({bridge.architecture}) has no multi-token-prediction layers "
                "(num_nextn_predict_layers); remove the key"
            )
        for on, what, why in (
            (trainer.lora.rank, "lora", "it freezes the model, its MTP layers included"),
            (trainer.share_prompts, "share_prompts", "its rows hold several responses back to back"),
        ):
            if on:
                raise ConfigError(
                    f"{key}={coef}: not with models.policy_trainer.{what} ({why}); set one of them to 0/false"
                )

    def _validate_layouts(self) -> None:
        rt, m = self.runtime_args, self.models
        devices = rt.trainer_devices
        for role in m.checked_roles:
            world = rt.world(role)
            if world != devices:
                where = f"runtime_args.reward_model_devices={world}"
            elif devices == rt.num_devices:
                where = f"runtime_args.num_devices={devices}"
            else:
                others = ("rollout_devices", "reward_model_devices", "judge_devices")
                where = f"the trainer's {devices} devices: runtime_args.num_devices={rt.num_devices} - " + " - ".join(
                    f"{k}={getattr(rt, k)}" for k in others if getattr(rt, k)
                )
            try:
                getattr(m, role).parallel.validate_world(world)
            except ValueError as err:
                raise ConfigError(f"models.{role}.parallel: {err} ({where})") from None
        for role in m.trained_roles:
            trainer = getattr(m, role)
            dp = trainer.parallel.dp(devices)
            if rt.train_global_batch_size % (trainer.micro_batch_size * dp):
                raise ConfigError(
                    f"runtime_args.train_global_batch_size={rt.train_global_batch_size} is not a multiple of "
                    f"models.{role}.micro_batch_size={trainer.micro_batch_size} x data-parallel size {dp}"
                )
        rollout_tp = m.policy.rollout.tensor_parallel_size
        if rt.engine_devices % rollout_tp:
            key = "num_devices" if rt.colocated else "rollout_devices"
            raise ConfigError(
                f"models.policy.rollout.tensor_parallel_size={rollout_tp} does not divide "
                f"runtime_args.{key}={rt.engine_devices}: each rollout replica takes tensor_parallel_size devices"
            )


def _check_model_dir(key: str, path: str) -> None:
    if not path:
        raise ConfigError(f"{key}: no model directory given (an HF directory with config.json)")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"{key}={path!r}: no config.json; expected an HF model directory or a converted Megatron checkpoint"
        )


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load, interpolate, type-check and validate a run's YAML (``overrides``: ``dotted.key=value``)."""
    config = load_config(RunConfig, path, overrides)
    config.validate()
    return config
