"""The run config: defaults interpolate, sizes are checked against devices and the model, keys are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.gguf2hf import default_model_dir
from mcore_rl.config.loader import ConfigError
from mcore_rl.config.schema import load_run_config


@pytest.fixture()
def run_yaml(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"runtime_args:\n  exp_name: t\n  output_dir: {tmp_path}/${{runtime_args.exp_name}}\n  num_devices: 3\n"
        f"  sample_per_episode: 24\n  train_global_batch_size: 12\n"
        f"models:\n  policy_trainer:\n    load: {default_model_dir()}\n    parallel: {{tp: 3}}\n"
        f"  policy:\n    num_inference_per_prompt: 4\n    rollout: {{tensor_parallel_size: 1}}\n"
    )
    return path


def test_a_valid_config_resolves_references(run_yaml, tmp_path):
    config = load_run_config(
        run_yaml, ["models.policy.rollout.train.temperature=0.8", "models.policy_trainer.max_token_in_packing=1024"]
    )
    assert config.models.ref_policy.max_token_in_packing == 1024  # the reference scores in the trainer's packs
    assert config.runtime_args.output_dir == f"{tmp_path}/t"
    assert config.models.ref_policy.load == config.models.policy.load == str(default_model_dir())
    assert config.models.policy.rollout.train.temperature == 0.8


@pytest.mark.parametrize(
    "override,message",
    [
        ("models.policy.num_inference_per_prompt=5", r"sample_per_episode=24 is not a multiple of .*=5"),
        ("runtime_args.train_global_batch_size=7", r"sample_per_episode=24 is not a multiple of .*=7"),
        ("models.policy_trainer.micro_batch_size=5", r"micro_batch_size=5 x data-parallel size 1"),
        ("models.policy_trainer.parallel.tp=2", r"models.policy_trainer.parallel: world size 3 is not divisible by"),
        ("models.ref_policy.parallel.ep=3", r"models.ref_policy.parallel: .*expert"),
        ("models.ref_policy.parallel.pp=2", r"models.ref_policy.parallel"),
        ("models.policy.rollout.tensor_parallel_size=2", r"tensor_parallel_size=2 does not divide .*num_devices=3"),
        ("models.policy_trainer.load=/nowhere", r"models.policy_trainer.load='/nowhere': no config.json"),
        ("runtime_args.data_path=/nowhere.jsonl", r"runtime_args.data_path='/nowhere.jsonl': file not found"),
        ("runtime_args.colocation=[policy]", r"runtime_args.colocation: unknown key"),
        ("runtime_args.log.console_every=5", r"runtime_args.log.console_every: unknown key"),
        ("models.policy_trainer.algorithm.loss_agg=mean", r"models.policy_trainer.algorithm.loss_agg='mean'"),
        ("models.policy.rollout.train.top_p=0", r"^models.policy.rollout.train.top_p=0.0: expected in \(0, 1\]"),
        ("models.policy.rollout.eval.max_new_tokens=0", r"^models.policy.rollout.eval.max_new_tokens=0: expected at"),
        ("models.policy.sync.bucket_bytes=0", r"^models.policy.sync.bucket_bytes=0: expected a positive number"),
        ("models.policy.rollout.return_routed_experts=true", r"set by models.policy_trainer.moe.routing_replay"),
        ("models.policy_trainer.parallel.tp=0", r"models.policy_trainer.parallel: "),
        ("models.reward.fnn=math", r"models.reward.fnn: unknown key; did you mean 'fn'\?"),
        ("models.policy_trainer.moe.aux_loss_coeff=0.01", r"moe.aux_loss_coeff=0.01: LlamaForCausalLM has no experts"),
        (
            "models.policy_trainer.recompute=selective",
            r"models.policy_trainer.recompute='selective': expected one of \['none', 'full'\]",
        ),
        ("runtime_args.device_memory_gb=-1", r"runtime_args.device_memory_gb=-1.0: expected >= 0"),
        ("models.policy_trainer.advantage_estimator=ppo", r"advantage_estimator='ppo': expected one of \['dr_grpo'"),
        ("models.policy_trainer.advantage_std_norm=false", r"advantage_std_norm: unknown key"),
        (
            "runtime_args.watchdog.action=kill",
            r"runtime_args.watchdog.action='kill': expected one of \['wait', 'stop'\]",
        ),
        ("models.critic.optimizer.lr_decay_style=step", r"lr_decay_style='step': expected one of \['constant', 'cosi"),
        ("runtime_args.watchdog.min_s=0", r"runtime_args.watchdog.min_s=0.0: expected a positive number"),
        (
            "runtime_args.eval_sets={gsm: /nowhere.jsonl}",
            r"runtime_args.eval_sets.gsm='/nowhere.jsonl': file not found",
        ),
        ("runtime_args.eval_sets={a/b: builtin:arithmetic}", r"runtime_args.eval_sets.a/b: name a set with letters"),
        ("runtime_args.log.verbose=maybe", r"runtime_args.log.verbose: expected bool, got .maybe."),
    ],
)
def test_bad_configs_are_refused_with_the_key(run_yaml, override, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(run_yaml, [override])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["runtime_args.rollout_devices=3"], r"rollout_devices=3: expected 0 \(shared\) or more, leaving the trainer"),
        (
            ["runtime_args.rollout_devices=1", "runtime_args.judge_devices=-1"],
            r"runtime_args.rollout_devices=1, judge_devices=-1: expected 0 \(shared\) or more",
        ),
        (["runtime_args.reward_model_devices=1"], r"reward_model_devices=1: devices for a role the run has not; set m"),
        (["runtime_args.rollout_mode=async"], r"rollout_mode='async' overlaps .*rollout_devices > 0"),
        (["runtime_args.rollout_mode=eager"], r"rollout_mode='eager': expected one of \['sync', 'one_step_off'"),
        # the trainer keeps 2 of the 3 devices: its tp=3 no longer fits them
        (
            ["runtime_args.rollout_devices=1"],
            r"policy_trainer.parallel: .*the trainer's 2 devices: .*rollout_devices=1",
        ),
        (
            ["runtime_args.rollout_devices=1", "models.policy_trainer.parallel.tp=1", "models.ref_policy.parallel.tp=1"]
            + ["models.policy.rollout.tensor_parallel_size=2"],
            r"tensor_parallel_size=2 does not divide runtime_args.rollout_devices=1",
        ),
        (
            ["runtime_args.rollout_devices=2", "models.policy_trainer.parallel.tp=1", "models.ref_policy.parallel.tp=1"]
            + ["runtime_args.rollout_mode=async", "runtime_args.max_staleness=0"],
            r"runtime_args.max_staleness=0: async rollout needs at least 1",
        ),
        (["runtime_args.max_engine_replacements=-1"], r"max_engine_replacements=-1: expected 0 \(a dead engine stops"),
    ],
)
def test_bad_placements_are_refused_with_the_key_and_the_fix(run_yaml, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(run_yaml, overrides)


def test_a_disaggregated_placement_splits_the_devices(run_yaml):
    config = load_run_config(
        run_yaml,
        ["runtime_args.rollout_devices=2", "models.policy_trainer.parallel.tp=1", "models.ref_policy.parallel.tp=1"]
        + ["runtime_args.rollout_mode=one_step_off", "models.policy.rollout.tensor_parallel_size=2"],
    )
    rt = config.runtime_args
    assert (rt.trainer_devices, rt.engine_devices, rt.colocated) == (1, 2, False)


def test_expert_bias_updates_need_routers_with_a_bias(tmp_path):
    from mcore_rl.trainer.moe import MoEConfig
    from models.registry import get_bridge
    from tests.tiny import make_tiny

    qwen3_moe = get_bridge(make_tiny("Qwen3MoeForCausalLM", tmp_path / "qwen3_moe"))
    deepseek = get_bridge(make_tiny("DeepseekV3ForCausalLM", tmp_path / "deepseek"))
    with pytest.raises(ValueError, match=r"moe.expert_bias_update_rate=0.001: Qwen3MoeForCausalLM's routers have no"):
        MoEConfig(expert_bias_update_rate=1e-3).validate("moe", qwen3_moe)
    MoEConfig(expert_bias_update_rate=1e-3).validate("moe", deepseek)
    assert MoEConfig().overrides(qwen3_moe) == dict(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    assert MoEConfig(expert_bias_update_rate=1e-3).overrides(deepseek)["moe_router_bias_update_rate"] == 1e-3


def test_the_engine_must_load_hf_weights_the_trainer_may_load_megatron(run_yaml, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    converted = tmp_path / "converted"  # what mcore-rl-hf2mcore leaves: config files beside model/ (torch_dist)
    dcp.save({"embedding.word_embeddings.weight": torch.zeros(4, 2)}, checkpoint_id=converted / "model", no_dist=True)
    (converted / "config.json").write_bytes((default_model_dir() / "config.json").read_bytes())
    (converted / "model" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    config = load_run_config(
        run_yaml, [f"models.policy_trainer.load={converted}", f"models.policy.load={default_model_dir()}"]
    )
    assert config.models.ref_policy.load == str(converted)
    with pytest.raises(ConfigError, match=r"models.policy.load=.*a Megatron checkpoint.*set it to the HF directory"):
        load_run_config(run_yaml, [f"models.policy_trainer.load={converted}"])


def _resolves(dotted: str) -> bool:
    import dataclasses
    import typing

    from mcore_rl.config.schema import RunConfig

    node = RunConfig
    for part in dotted.split("."):
        if not (dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}):
            return False
        hint = typing.get_type_hints(node)[part]
        node = next((t for t in typing.get_args(hint) if dataclasses.is_dataclass(t)), hint)
    return True


def test_every_config_key_the_docs_name_exists():
    """Every ``runtime_args.*`` / ``models.*`` path in the README, the scripts and the shipped configs' comments is
    a key of the schema (a renamed key must not leave its old name in the docs)."""
    import re

    repo = Path(__file__).resolve().parents[2]
    texts = {p: p.read_text() for p in [repo / "README.md", *(repo / "scripts").rglob("*.sh")]}
    named = {
        (p.name, m.group(0).rstrip("."))
        for p, text in texts.items()
        for m in re.finditer(r"(?<![\w/.])(?<!from )(?<!import )(?:runtime_args|models)\.[A-Za-z_][\w.]*", text)
    }
    assert len(named) > 20
    assert not [(file, key) for file, key in sorted(named) if not _resolves(key)]


def test_shared_prompts_are_checked_up_front(run_yaml, tmp_path):
    from tests.tiny import make_tiny

    share = "models.policy_trainer.share_prompts=true"
    assert load_run_config(run_yaml, [share]).models.ref_policy.share_prompts  # the reference follows the trainer
    with pytest.raises(ConfigError, match=r"share_prompts: a step's 1 prompt groups .* each of the 3 data-parallel"):
        load_run_config(
            run_yaml, [share, "models.policy_trainer.parallel.tp=1", "runtime_args.train_global_batch_size=6"]
        )
    with pytest.raises(ConfigError, match=r"models.policy_trainer.share_prompts: .*parallel.cp=3"):
        load_run_config(run_yaml, [share, "models.policy_trainer.parallel.tp=1", "models.policy_trainer.parallel.cp=3"])
    deepseek = make_tiny("DeepseekV3ForCausalLM", tmp_path / "deepseek")
    with pytest.raises(ConfigError, match=r"models.ref_policy.share_prompts: .*uses MLA: True"):
        load_run_config(run_yaml, ["models.ref_policy.share_prompts=true", f"models.ref_policy.load={deepseek}",
                                   "models.ref_policy.parallel.tp=1"])  # fmt: skip
    qwen3_next = make_tiny("Qwen3NextForCausalLM", tmp_path / "qwen3_next")
    with pytest.raises(ConfigError, match=r"models.ref_policy.share_prompts: .*linear attention: True"):
        load_run_config(run_yaml, ["models.ref_policy.share_prompts=true", f"models.ref_policy.load={qwen3_next}",
                                   "models.ref_policy.parallel.tp=1"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"parallel.cp=3: Gated DeltaNet has no context parallelism"):
        load_run_config(run_yaml, [f"models.policy_trainer.load={qwen3_next}", "models.policy_trainer.parallel.tp=1",
                                   "models.policy_trainer.parallel.cp=3"])  # fmt: skip
    gpt_oss = make_tiny("GptOssForCausalLM", tmp_path / "gpt_oss")
    with pytest.raises(ConfigError, match=r"models.ref_policy.share_prompts: .*sliding windows: True"):
        load_run_config(run_yaml, ["models.ref_policy.share_prompts=true", f"models.ref_policy.load={gpt_oss}",
                                   "models.ref_policy.parallel.tp=1"])  # fmt: skip


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["models.reward.env=chess"], r"models.reward.env='chess': expected one of \['answer', 'python'\] or an"),
        (["models.reward.tools=[calculator, /no/tools.py:t]"], r"models.reward.tools\[1\]='/no/tools.py:t': expected"),
        (["models.reward.tools=[calculator]", "models.reward.tool_actors=0"], r"models.reward.tool_actors=0: expected"),
        (["models.reward.env=python", "models.reward.env_timeout_s=0"], r"models.reward.env_timeout_s=0.0: expected a"),
        (["models.reward.env=python", "models.reward.sandbox.memory_mb=8"], r"models.reward.sandbox.memory_mb=8: "),
        (
            ["models.reward.tools=[calculator]", "models.policy.rollout.multi_turn.max_total_tokens=200"],
            r"multi_turn.max_total_tokens=200 leaves no room after a prompt of models.policy.max_prompt_tokens=256",
        ),
        (
            ["models.reward.tools=[python]", "models.policy.rollout.multi_turn.max_total_tokens=5000"],
            r"multi_turn.max_total_tokens=5000: expected 0 \(max_model_len\) up to max_model_len=2048",
        ),
        (["models.reward.env=answer", "models.policy.rollout.multi_turn.max_turns=0"], r"multi_turn.max_turns=0: exp"),
        (
            ["models.reward.tools=[calculator]", "models.policy.rollout.multi_turn.max_tool_calls_per_turn=0"],
            r"multi_turn.max_tool_calls_per_turn=0: expected at least 1",
        ),
        (
            ["models.reward.tools=[calculator]", "models.policy.rollout.multi_turn.max_observation_chars=0"],
            r"multi_turn.max_observation_chars=0: expected at least 1",
        ),
        (
            ["models.reward.tools=[calculator]", "models.policy.rollout.multi_turn.tool_format=json"],
            r"multi_turn.tool_format='json': expected 'auto' or one of \['deepseek_v3', 'glm45', ",
        ),
        (["models.reward.timeout_s=0"], r"models.reward.timeout_s=0.0: expected a positive number of seconds"),
        (
            ["models.policy_trainer.overlong_buffer=64", "models.policy.rollout.train.max_new_tokens=64"],
            r"overlong_buffer=64: expected fewer than models.policy.rollout.train.max_new_tokens=64",
        ),
        (
            ["models.policy_trainer.overlong_buffer=8", "models.reward.tools=[calculator]"],
            r"overlong_buffer=8: overlong shaping is measured against one response's max_new_tokens",
        ),
        (["models.policy_trainer.overlong_penalty=-1"], r"overlong_penalty: expected >= 0"),
        (
            ["models.reward.env=answer", "models.policy_trainer.max_token_in_packing=1024"],
            r"max_token_in_packing=1024 is below the longest sample \(2048 tokens: a multi-turn trajectory's max_",
        ),
        (
            ["models.reward.env=answer", "models.policy.rollout.multi_turn.rewritten_history=restart"],
            r"multi_turn.rewritten_history='restart': expected one of \['refuse', 'new_sample'\]",
        ),
        (
            ["models.reward.env=answer", "models.policy.rollout.multi_turn.rewritten_history=new_sample"],
            r"rewritten_history=new_sample: a step's rows vary .* set models.policy_trainer.max_token_in_packing > 0",
        ),
        (
            [
                "models.reward.env=answer",
                "models.policy.rollout.multi_turn.rewritten_history=new_sample",
                "models.policy_trainer.max_token_in_packing=4096",
                "models.policy_trainer.share_prompts=true",
            ],
            r"rewritten_history=new_sample: .* and share_prompts: false",
        ),
        (
            [
                "models.reward.env=answer",
                "models.policy.rollout.multi_turn.rewritten_history=new_sample",
                "models.policy_trainer.max_token_in_packing=4096",
                "models.policy_trainer.advantage_estimator=reinforce_pp",
            ],
            r"advantage_estimator='reinforce_pp' chains the advantages of a trajectory's tokens, which its samples",
        ),
    ],
)
def test_bad_multi_turn_settings_are_refused_up_front(run_yaml, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(run_yaml, overrides)


def test_the_python_tool_is_refused_without_kernel_isolation(run_yaml, monkeypatch, caplog):
    """Detection forced to fail: a run that would execute the policy's code stops before anything starts, unless
    the unsafe key says otherwise; a run without the python tool does not care."""
    from mcore_rl.agent import sandbox

    monkeypatch.setattr(sandbox, "probe", lambda config: sandbox.Isolation(errors={"landlock": "not in this kernel"}))
    for overrides in (["models.reward.tools=[calculator, python]"], ["models.reward.env=python"]):
        with pytest.raises(ConfigError, match=r"models.reward: the python sandbox needs the kernel's Landlock and "
                                              r"seccomp.*landlock: not in this kernel.*unsafe_without_kernel_isolation"):  # fmt: skip
            load_run_config(run_yaml, overrides)
    unsafe = ["models.reward.env=python", "models.reward.sandbox.unsafe_without_kernel_isolation=true"]
    assert load_run_config(run_yaml, unsafe).models.reward.runs_code
    assert "WITHOUT kernel isolation" in caplog.text
    assert load_run_config(run_yaml, ["models.reward.tools=[calculator]"]).models.reward.multi_turn


def test_multi_turn_settings_from_user_files(run_yaml, tmp_path):
    (tmp_path / "env.py").write_text("class Environment:\n    pass\n")
    config = load_run_config(
        run_yaml, [f"models.reward.env={tmp_path}/env.py", "models.reward.tools=[calculator, python]"]
    )
    assert config.models.reward.multi_turn and config.models.reward.tools == ["calculator", "python"]
    assert config.models.policy.rollout.multi_turn.total_tokens(config.models.policy.rollout.max_model_len) == 2048
    assert not load_run_config(run_yaml).models.reward.multi_turn  # single-turn unless an env or tools are given


def test_an_agent_program_stands_instead_of_an_environment_and_tools(run_yaml, tmp_path):
    (tmp_path / "agent.py").write_text("def run(base_url, api_key, row):\n    return 1.0\n")
    agent = f"models.reward.agent={tmp_path}/agent.py:run"
    config = load_run_config(run_yaml, [agent, "models.reward.agent_actors=8"])
    assert config.models.reward.multi_turn and not config.models.reward.runs_code
    for overrides, message in [
        (["models.reward.tools=[calculator]"], r"models.reward.agent=.*brings its own loop and tools; leave models.re"),
        (["models.reward.env=python"], "leave models.reward.env and models.reward.tools empty"),
        (["models.reward.agent_actors=0"], r"models.reward.agent_actors=0: expected at least 1"),
        (["models.reward.agent_timeout_s=0"], r"models.reward.agent_timeout_s=0.0: expected a positive number"),
        (["models.reward.agent=/no/agent.py"], r"models.reward.agent='/no/agent.py': expected an existing path/to/"),
        (["models.reward.terms=[{name: x, fn: math}]"], "models.reward.terms: weighted rewards score single-turn"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_run_config(run_yaml, [agent, *overrides])


GAE = ["models.policy_trainer.advantage_estimator=gae", "models.critic.load=${models.policy_trainer.load}"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["models.policy_trainer.advantage_estimator=gae"], r"advantage_estimator='gae' needs PPO's critic: set "),
        ([GAE[1]], r"models.critic.load='.*': only models.policy_trainer.advantage_estimator='gae' uses a critic"),
        ([*GAE, "models.critic.parallel.tp=2"], r"models.critic.parallel: world size 3 is not divisible"),
        ([*GAE, "models.critic.micro_batch_size=5"], r"models.critic.micro_batch_size=5 x data-parallel size 3"),
        ([*GAE, "models.critic.warmup_episodes=10"], r"models.critic.warmup_episodes=10: expected 0 up to .* = 9"),
        ([*GAE, "models.critic.value_clip=-1"], r"models.critic.value_clip: expected >= 0"),
        ([*GAE, "models.policy_trainer.lam=1.5"], r"models.policy_trainer.lam=1.5: expected a number in \[0, 1\]"),
        (
            ["models.policy_trainer.reward_kl_coef=0.1"],
            r"reward_kl_coef=0.1: a KL penalty in the per-token reward needs a per-token estimator .* "
            r"use models.policy_trainer.algorithm.kl_coef",
        ),
        (["models.policy_trainer.distill_coef=0.5"], r"distill_coef=0.5 needs a teacher: set models.teacher.load"),
        (["models.teacher.load=${models.policy_trainer.load}"], r"models.teacher.load=.*: the teacher is used by on-"),
        (["models.policy_trainer.advantage_estimator=none"], r"advantage_estimator='none' trains on the teacher's"),
    ],
)
def test_estimator_critic_and_teacher_keys_are_refused_with_the_fix(run_yaml, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(run_yaml, overrides)


def test_a_teacher_or_critic_with_another_vocabulary_is_refused(run_yaml, tiny_models):
    """The teacher and the critic score the policy's token ids: a model with another tokenizer is refused by key
    before anything starts (with the weights' check); one with the policy's is taken."""
    other = tiny_models["LlamaForCausalLM"]  # tests/tiny.py's character tokenizer
    teacher = load_run_config(run_yaml, ["models.policy_trainer.distill_coef=0.5", f"models.teacher.load={other}"])
    with pytest.raises(ConfigError, match=r"models.teacher.load='.*': its tokenizer is not the policy's \("):
        teacher.check_files()  # a run's check of the directories' files (a dry run needs config.json only)
    with pytest.raises(ConfigError, match=r"models.critic.load='.*': its tokenizer is not the policy's"):
        load_run_config(run_yaml, [GAE[0], f"models.critic.load={other}"]).check_files()
    config = load_run_config(run_yaml, [*GAE, "models.critic.parallel.tp=3", "models.policy_trainer.gamma=0.99"])
    assert config.models.megatron_roles == ["policy_trainer", "critic"]
    assert config.models.critic.optimizer.lr == 1e-5 and config.models.critic.load == str(default_model_dir())


def test_a_reward_model_starts_a_critic_only(run_yaml, tmp_path):
    """A one-label *ForSequenceClassification checkpoint has a score head and no LM head: the critic may start from
    it; a role that generates or scores tokens may not, and says so by key."""
    import transformers

    from models.registry import get_bridge
    from tests.tiny import COMMON, save_char_tokenizer

    config = transformers.LlamaConfig(**COMMON, architectures=["LlamaForSequenceClassification"], num_labels=1)
    transformers.LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    save_char_tokenizer(tmp_path / "rm")
    assert get_bridge(tmp_path / "rm").value_model and not get_bridge(default_model_dir()).value_model
    with pytest.raises(ConfigError, match=r"models.policy_trainer.load='.*rm': a reward model .* needs a causal LM"):
        load_run_config(run_yaml, [f"models.policy_trainer.load={tmp_path}/rm", "models.policy_trainer.parallel.tp=1"])
    with pytest.raises(ConfigError, match=r"models.critic.load='.*rm': its tokenizer is not the policy's"):
        load_run_config(run_yaml, [GAE[0], f"models.critic.load={tmp_path}/rm"]).check_files()  # the vocab differs
    two = config.to_dict() | {"id2label": {"0": "LABEL_0", "1": "LABEL_1"}}  # how config.json stores num_labels
    with pytest.raises(ValueError, match=r"LlamaForSequenceClassification with 2 labels: a value head has one"):
        get_bridge(two)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["models.reward.terms=[{name: math, fn: math}]"],
            r"models.reward.terms\[0\].name='math' is also models.reward's",
        ),
        (
            ["models.reward.fn=", "models.reward.terms=[]"],
            r"models.reward.fn is empty, and neither models.reward.terms, models.reward_model nor models.judge",
        ),
        (["models.reward.weight=2"], r"models.reward.weight=2.0: weighs models.reward.fn in a sum with"),
        (["models.reward.terms=[{name: x}]"], r"models.reward.terms\[0\].fn: no reward function"),
        (["models.reward.terms=[{fn: math}]"], r"models.reward.terms\[0\].name: empty"),
        (["models.reward.terms=[{name: x, fn: math, weight: .nan}]"], r"models.reward.terms\[0\].weight=nan: expected"),
        (["models.reward.terms=[{name: x, fn: math}]", "models.reward.tools=[calculator]"], r"models.reward.terms: "),
    ],
)
def test_reward_terms_are_refused_with_the_fix(run_yaml, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(run_yaml, overrides)


def test_reward_terms_are_the_functions_with_their_names_and_weights(run_yaml):
    config = load_run_config(run_yaml, ["models.reward.weight=0.5", "models.reward.terms=[{name: brief, fn: math}]"])
    assert [(key, t.name, t.fn, t.weight) for key, t in config.models.reward.weighted_terms] == [
        ("models.reward.fn", "math", "math", 0.5),
        ("models.reward.terms[0].fn", "brief", "math", 1.0),
    ]


def test_a_reward_model_is_refused_by_key_when_it_is_none(run_yaml, tmp_path):
    """models.reward_model.load must be a one-label sequence classifier with a chat template, named apart from the
    other rewards."""
    import transformers

    from tests.tiny import COMMON, save_char_tokenizer

    with pytest.raises(ConfigError, match=r"models.reward_model.load='.*': LlamaForCausalLM is no reward model; ex"):
        load_run_config(run_yaml, [f"models.reward_model.load={default_model_dir()}"])
    config = transformers.LlamaConfig(**COMMON, architectures=["LlamaForSequenceClassification"], num_labels=1)
    transformers.LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    with pytest.raises(ConfigError, match=r"models.reward_model.name='math' is also models.reward's name"):
        load_run_config(run_yaml, [f"models.reward_model.load={tmp_path}/rm", "models.reward_model.name=math"])
    run = load_run_config(run_yaml, [f"models.reward_model.load={tmp_path}/rm", "models.reward_model.weight=0.5"])
    assert run.models.megatron_roles == ["policy_trainer", "reward_model"]
    with pytest.raises(ConfigError, match=r"models.reward_model.load='.*rm': its tokenizer does not load"):
        run.check_files()
    save_char_tokenizer(tmp_path / "rm")
    run.check_files()  # its own tokenizer and chat template: another vocabulary than the policy's is fine


JUDGE = ["models.judge.load=policy", "models.judge.template='Grade {response}'"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["models.judge.load=/some/model", "models.judge.template='{response}'"],
            r"judge.load='/some/model': no confi",
        ),
        (
            [*JUDGE, "runtime_args.judge_devices=1"],
            r"runtime_args.judge_devices: size a judge's own engines, but models",
        ),
        (
            [*JUDGE, "models.judge.max_model_len=64"],
            r"models.judge.max_model_len: size a judge's own engines, but mode",
        ),
        (
            [*JUDGE, "models.judge.parser=/no/p.py:f"],
            r"parser='/no/p.py:f': expected one of \['score_tag', 'yes_no'\] or",
        ),
        (["models.judge.load=policy"], r"models.judge.template: no \{response\} placeholder"),
        ([*JUDGE, "models.judge.parser=json"], r"models.judge.parser='json': expected one of \['score_tag', 'yes_"),
        ([*JUDGE, "models.judge.name=math"], r"models.judge.name='math' is also models.reward's name"),
        ([*JUDGE, "models.judge.timeout_s=0"], r"models.judge: expected a finite weight, timeout_s > 0"),
        (
            [
                *JUDGE,
                "runtime_args.rollout_devices=1",
                "runtime_args.rollout_mode=async",
                "models.policy_trainer.parallel.tp=1",
                "models.ref_policy.parallel.tp=1",
            ],
            r"models.judge.load='policy' with runtime_args.rollout_mode='async'",
        ),  # fmt: skip
    ],
)
def test_judge_keys_are_refused_with_the_fix(run_yaml, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(run_yaml, overrides)


def test_a_model_of_an_unknown_family_is_named_by_key(run_yaml, tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"architectures": ["GPT2ForSequenceClassification"]}')
    with pytest.raises(ConfigError, match=r"models.reward_model.load='.*gpt2': architecture 'GPT2ForSequenceClass"):
        load_run_config(run_yaml, [f"models.reward_model.load={tmp_path}/gpt2"])


def test_device_pools_are_laid_out_trainer_rollout_reward_model_judge():
    from mcore_rl.config.schema import RuntimeArgs

    split = RuntimeArgs(num_devices=8, rollout_devices=3, reward_model_devices=2, judge_devices=1)
    pools = ("trainer", "rollout", "reward_model", "judge")
    assert [split.devices(p) for p in pools] == [range(0, 2), range(2, 5), range(5, 7), range(7, 8)]
    assert (split.trainer_devices, split.engine_devices, split.world("reward_model"), split.world("critic")) == (
        2, 3, 2, 2,
    )  # fmt: skip
    colocated = RuntimeArgs(num_devices=4, reward_model_devices=1)
    assert [colocated.devices(p) for p in pools] == [range(0, 3), range(0, 3), range(3, 4), range(4, 4)]
    assert colocated.engine_devices == colocated.world("reward_model") + 2 == 3


def test_a_judge_of_its_own_is_checked_like_a_model_and_sized_like_an_engine(run_yaml, tmp_path):
    """A judge loaded from a model directory: its engines sit beside the policy's (their CUDA shares must fit
    together) or on devices of their own, which its tensor parallelism must divide; its weights and chat template
    are checked with the other models'; it may judge an async run (its weights never change)."""
    from tests.tiny import make_tiny

    judge = make_tiny("LlamaForCausalLM", tmp_path / "judge")
    own = [f"models.judge.load={judge}", "models.judge.template='{response}'", "models.judge.max_model_len=128"]
    config = load_run_config(run_yaml, own)
    assert "models.judge.load" in config.model_keys and config.models.judge.own_engines
    engine = config.models.judge.engine_config(config.models.policy.rollout)
    assert (engine.max_model_len, engine.sleep_level, engine.stop_strings) == (128, 1, False)
    config.check_files()
    (judge / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match=r"models.judge.load='.*judge': its tokenizer has no chat template"):
        config.check_files()
    bad = [
        (["models.judge.gpu_memory_utilization=0.5"], r"judge.gpu_memory_utilization=0.5 \+ models.policy.rollout."),
        (["models.judge.max_new_tokens=128"], r"models.judge: expected 0 < gpu_memory_utilization < 1 and max_new_t"),
        (
            ["runtime_args.judge_devices=2", "models.policy_trainer.parallel.tp=1", "models.judge.tensor_parallel_size=3"],
            r"judge.tensor_parallel_size=3 does not divide runtime_args.judge_devices \(2\)",
        ),
    ]  # fmt: skip
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_run_config(run_yaml, own + overrides)
    async_run = ["runtime_args.rollout_devices=1", "runtime_args.judge_devices=1", "runtime_args.rollout_mode=async"]
    layout = ["models.policy_trainer.parallel.tp=1", "models.ref_policy.parallel.tp=1"]
    config = load_run_config(run_yaml, own + async_run + layout)
    assert config.runtime_args.devices("judge") == range(2, 3)


def test_lora_keys_are_checked_and_replace_the_reference_role(run_yaml, tmp_path):
    """LoRA settings are refused by key with the fix; with a KL term, the reference is the trainer's model with
    its adapters off, so no reference role starts (and the planner counts no reference weights)."""
    from tests.tiny import MOONLIGHT, make_tiny

    bad = [
        (["models.policy_trainer.lora.rank=-1"], r"lora: expected rank >= 0 and alpha > 0 \(got rank -1"),
        (["models.policy_trainer.lora.rank=8", "models.policy_trainer.lora.alpha=0"], r"alpha > 0 \(got rank 8"),
        (["models.policy_trainer.lora.targets=[q_proj]"], r"lora.targets: \['q_proj'\] are no adaptable linears"),
        (["models.policy_trainer.lora.rank=8", "models.policy_trainer.lora.targets=[]"], r"lora.targets: empty"),
        (["models.policy_trainer.lora.dropout=1"], r"lora.dropout=1.0: expected a probability in \[0, 1\)"),
        (["models.policy_trainer.lora.train_router=true"], r"lora.train_router: LoRA's \(rank 0 trains the whole"),
        (
            ["models.policy_trainer.lora.rank=8", "models.policy_trainer.lora.train_router=true"],
            r"lora.train_router: .* has no MoE router; set it false",
        ),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_run_config(run_yaml, overrides)
    kl = ["models.policy_trainer.algorithm.kl_coef=0.01"]
    assert load_run_config(run_yaml, kl).models.megatron_roles == ["policy_trainer", "ref_policy"]
    lora = load_run_config(run_yaml, [*kl, "models.policy_trainer.lora.rank=8"]).models
    assert lora.megatron_roles == ["policy_trainer"] and lora.needs_reference
    layout = ["models.policy_trainer.parallel.tp=1", "models.ref_policy.parallel.tp=1", "runtime_args.num_devices=1"]
    for arch, extra, missing in (
        ("DeepseekV3ForCausalLM", MOONLIGHT, r"\['linear_qkv'\]"),  # MLA; its shared experts' MLP is adapted
        ("Qwen3MoeForCausalLM", {}, r"\['linear_fc1', 'linear_fc2'\]"),  # routed experts only
    ):
        model = make_tiny(arch, tmp_path / arch, **extra)
        with pytest.raises(ConfigError, match=rf"lora.targets: {missing} match no linear of .*; adapt \["):
            load_run_config(
                run_yaml, [f"models.policy_trainer.load={model}", "models.policy_trainer.lora.rank=8", *layout]
            )
    # the routed experts' adapters: whole per expert, so expert tensor parallelism 1
    experts = [
        f"models.policy_trainer.load={tmp_path / 'Qwen3MoeForCausalLM'}",
        "models.policy_trainer.lora.rank=8",
        "models.policy_trainer.lora.targets=[linear_qkv,experts.linear_fc1,experts.linear_fc2]",
        "models.policy_trainer.parallel.tp=2",
        "models.policy_trainer.parallel.sequence_parallel=true",
        "models.ref_policy.parallel.tp=1",
        "runtime_args.num_devices=2",
    ]
    with pytest.raises(ConfigError, match=r"\['experts.linear_fc1', 'experts.linear_fc2'\] need expert tensor .* 2;"):
        load_run_config(run_yaml, experts)
    assert load_run_config(run_yaml, [*experts, "models.policy_trainer.parallel.etp=1"]).models.policy_trainer.lora.rank
    # DeepSeek-V3's expert bias moves only with its routers trained: LoRA freezes them unless told
    deepseek = [
        f"models.policy_trainer.load={tmp_path / 'DeepseekV3ForCausalLM'}",
        "models.policy_trainer.lora.rank=8",
        "models.policy_trainer.lora.targets=[linear_proj]",
        "models.policy_trainer.moe.expert_bias_update_rate=0.001",
        *layout,
    ]
    with pytest.raises(ConfigError, match=r"expert_bias_update_rate: moves .* set models.policy_trainer.lora.train_r"):
        load_run_config(run_yaml, deepseek)
    assert load_run_config(run_yaml, [*deepseek, "models.policy_trainer.lora.train_router=true"])


def test_adapter_sync_needs_adapters_vllm_can_serve_and_engines_that_keep_their_base(run_yaml, tmp_path):
    """models.policy.sync.lora: adapter is refused by key with the fix: without LoRA, with routed experts'
    adapters (no PEFT form), above vLLM's largest LoRA rank, or with engines that drop their weights when they sleep;
    the engines' LoRA rank is the driver's to set."""
    from tests.tiny import make_tiny

    adapter = ["models.policy.sync.lora=adapter", "models.policy.rollout.sleep_level=1"]
    rank = "models.policy_trainer.lora.rank"
    moe = make_tiny("Qwen3MoeForCausalLM", tmp_path / "moe")
    moe_layout = [
        "models.policy_trainer.parallel.tp=1",
        "models.ref_policy.parallel.tp=1",
        "runtime_args.num_devices=1",
    ]
    experts = [
        f"models.policy_trainer.load={moe}",
        *moe_layout,
        "models.policy_trainer.lora.targets=[experts.linear_fc1]",
    ]
    mla = [f"models.policy_trainer.load={make_tiny('DeepseekV3ForCausalLM', tmp_path / 'mla')}", *moe_layout]
    mla.append("models.policy_trainer.lora.targets=[linear_proj,linear_kv_up_proj]")
    routers = [f"models.policy_trainer.load={moe}", *moe_layout, "models.policy_trainer.lora.train_router=true"]
    routers.append("models.policy_trainer.lora.targets=[linear_qkv]")
    bad = [
        (["models.policy.sync.lora=both"], r"models.policy.sync.lora='both': expected 'merged' or 'adapter'"),
        (adapter, r"sync.lora='adapter' syncs LoRA adapters, but models.policy_trainer.lora.rank is 0"),
        ([*adapter, f"{rank}=8", *experts], r"routed experts' adapters \(\['experts.linear_fc1'\]\) have no PEFT form"),
        ([*adapter, f"{rank}=1024"], r"vLLM serves LoRA ranks up to 512, models.policy_trainer.lora.rank is 1024"),
        (
            [adapter[0], f"{rank}=8"],
            r"keep their base weights across sleeps .* set models.policy.rollout.sleep_level: 1",
        ),
        (["models.policy.rollout.lora_rank=8"], r"models.policy.rollout.lora_rank: set from .*; remove it"),
        (
            [*adapter, f"{rank}=8", *mla],
            r"multi-latent attention's adapters \(\['linear_kv_up_proj'\]\) sync merged for now",
        ),
        (
            [*adapter, f"{rank}=8", *routers],
            r"the routers train beside the adapters .* sync them merged",
        ),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_run_config(run_yaml, overrides)
    assert load_run_config(run_yaml, [*adapter, f"{rank}=8"]).models.policy.sync.lora == "adapter"


def test_speculative_decoding_needs_mtp_layers_in_the_engines_model(run_yaml, tiny_models):
    """models.policy.rollout.speculative_tokens is refused by key with the fix: negative, on a model without MTP
    layers, or beside adapter-only sync; on DeepSeek-V3 it loads."""
    key = "models.policy.rollout.speculative_tokens"
    deepseek = [
        f"models.policy_trainer.load={tiny_models['DeepseekV3ForCausalLM']}",
        "models.policy_trainer.parallel.tp=1",
        "models.ref_policy.parallel.tp=1",
        "runtime_args.num_devices=1",
    ]
    adapter = ["models.policy.sync.lora=adapter", "models.policy.rollout.sleep_level=1"]
    adapter += ["models.policy_trainer.lora.rank=8", "models.policy_trainer.lora.targets=[linear_proj]"]
    bad = [
        ([f"{key}=-1"], rf"{key}=-1: expected 0 \(off\) or more"),
        ([f"{key}=2"], rf"{key}=2: .* \(LlamaForCausalLM\) has no multi-token-prediction layers .* set it to 0"),
        ([*deepseek, f"{key}=1", *adapter], rf"{key}=1: not with models.policy.sync.lora='adapter'"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_run_config(run_yaml, overrides)
    assert load_run_config(run_yaml, [*deepseek, f"{key}=2"]).models.policy.rollout.speculative_tokens == 2


def test_an_mtp_loss_needs_mtp_layers_and_trains_them_without_lora_or_shared_prompts(run_yaml, tiny_models):
    """mtp_loss_coef is refused by key with the fix: on a model without MTP layers, negative or not finite, with
    LoRA (the MTP layers stay frozen) or shared-prompt rows (responses back to back); on DeepSeek-V3 it loads."""
    deepseek = [
        f"models.policy_trainer.load={tiny_models['DeepseekV3ForCausalLM']}",
        "models.policy_trainer.parallel.tp=1",
        "models.ref_policy.parallel.tp=1",
        "runtime_args.num_devices=1",
    ]
    coef = "models.policy_trainer.mtp_loss_coef"
    bad = [
        ([f"{coef}=0.1"], r"mtp_loss_coef=0.1: .* \(LlamaForCausalLM\) has no multi-token-prediction layers"),
        ([*deepseek, f"{coef}=-1"], r"mtp_loss_coef=-1.0: expected a finite weight >= 0"),
        ([*deepseek, f"{coef}=.nan"], r"mtp_loss_coef=nan: expected a finite weight >= 0"),
        ([*deepseek, f"{coef}=0.1", "models.policy_trainer.lora.rank=8"], r"not with models.policy_trainer.lora"),
        ([*deepseek, f"{coef}=0.1", "models.policy_trainer.share_prompts=true"], r"not with .*share_prompts"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_run_config(run_yaml, overrides)
    assert load_run_config(run_yaml, [*deepseek, f"{coef}=0.1"]).models.policy_trainer.mtp_loss_coef == 0.1
