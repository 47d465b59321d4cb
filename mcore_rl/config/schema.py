"""The run configuration: one YAML file in ChatLearn's shape (``runtime_args`` + ``models.*``), typed and checked
before any actor starts. Errors name the key and say how to fix it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from mcore_rl.agent.sandbox import SandboxConfig
from mcore_rl.algorithms.grpo import PolicyLossConfig
from mcore_rl.config import checks, model_checks
from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.loggers import LogConfig
from mcore_rl.rewards.user import RewardTerm, default_name
from mcore_rl.rollout.engine import MultiTurnConfig, RolloutConfig, SamplingConfig
from mcore_rl.trainer.moe import MoEConfig
from mcore_rl.trainer.sync import SyncConfig
from mcore_rl.watchdog import WatchdogConfig
from models.lora import LoRAConfig
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
    # true: the optimizer state is gathered and saved per parameter, so a resume may change the parallel layout and
    # the number of devices (saves take several times longer); false: each rank saves its own shard, and a resume
    # keeps the layout and devices
    save_reshardable: bool = False
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
    # rollout engines whose process dies are replaced (loaded with the current weights, their requests generated
    # again) this many times in a run; the next death stops it
    max_engine_replacements: int = 3
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
        Its weights never change, so a sleeping engine keeps them in host memory (sleep level 1); it samples as
        :class:`~mcore_rl.rewards.judge.Judge` asks, without the policy's stop strings."""
        return dataclasses.replace(
            policy, **{k: getattr(self, k) for k in self.ENGINE_KEYS}, sleep_level=1, return_routed_experts=False,
            multi_turn=MultiTurnConfig(), train=SamplingConfig(), eval=SamplingConfig(),
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
    # Instead of env and tools: a user's agent program drives each trajectory through the run's OpenAI-compatible
    # endpoint (mcore_rl/agent/programs.py): "path/to/file.py[:run]", run(base_url, api_key, row) -> reward or None
    agent: str = ""
    agent_actors: int = 4  # programs running at once, one CPU process each
    agent_timeout_s: float = 600.0  # a program past it is stopped: its trajectory ends, reward 0, counted
    agent_host: str = "127.0.0.1"  # the endpoint's address; loopback unless the programs run on other nodes

    @property
    def multi_turn(self) -> bool:
        return bool(self.env or self.tools or self.agent)

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
        """Everything that can be checked without starting an actor (:func:`checks.validate`); raises ConfigError
        naming the key."""
        try:
            checks.validate(self)
        except ConfigError:
            raise
        except ValueError as err:  # a component's own check (it names its field)
            raise ConfigError(str(err)) from None

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
        model_checks.check_files(self)

    @property
    def model_keys(self) -> list[str]:
        """The keys of the model directories the run loads: every Megatron role's, the rollout engines', and a
        judge's own."""
        judge = ["models.judge.load"] if self.models.judge.own_engines else []
        return [f"models.{role}.load" for role in self.models.checked_roles] + ["models.policy.load", *judge]

    def at(self, dotted: str):
        """The value at a dotted key (``models.policy.load``), as errors name it."""
        node = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load, interpolate, type-check and validate a run's YAML (``overrides``: ``dotted.key=value``)."""
    config = load_config(RunConfig, path, overrides)
    config.validate()
    return config
