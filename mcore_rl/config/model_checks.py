"""The checks of a run's model directories and the roles that load them: each family's layout, LoRA's targets,
MTP and drafting, reward models and tokenizers, and (before a run writes anything) the weights' files. Called by
:mod:`mcore_rl.config.checks`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from converters.hf_io import HFCheckpoint
from converters.hf_io import load_tokenizer as hf_load_tokenizer
from converters.torch_dist import Reader, find_megatron
from mcore_rl.config.loader import ConfigError
from mcore_rl.planner.params import Architecture, adaptable_linears
from mcore_rl.rollout.engine import vllm_lora_ranks
from models.lora import EXPERTS, MLA
from models.registry import BRIDGES, get_bridge

if TYPE_CHECKING:
    from mcore_rl.config.schema import RunConfig


def check_files(config: RunConfig) -> None:
    """The model directories' files: weights all there and whole (headers and sizes; no tensor is read), and the
    tokenizers the teacher, critic and reward model need. A run checks this before it writes anything; a dry run
    needs no weights or tokenizers, only config.json."""
    _check_weights(config)
    _vocabularies(config)
    if config.models.uses("reward_model"):
        _check_chat_template(config, "reward_model")
    if config.models.judge.own_engines:
        _check_chat_template(config, "judge")


def _role_keys(config: RunConfig) -> list[str]:
    """The Megatron roles' sections."""
    return [f"models.{role}" for role in config.models.checked_roles]


def _engine_keys(config: RunConfig) -> list[str]:
    """The sections of the models engines serve: the policy, and a judge's with engines of its own."""
    return ["models.policy"] + (["models.judge"] if config.models.judge.own_engines else [])


def models(config: RunConfig) -> None:
    """Model directories, the engines' HF weights, each role's family and layout, MoE, MTP, drafting."""
    m = config.models
    for key in config.model_keys:
        _check_model_dir(key, config.at(key))
    engines = _engine_keys(config)
    for key in engines:
        if find_megatron(config.at(key).load):
            raise ConfigError(
                f"{key}.load={config.at(key).load!r}: a Megatron checkpoint, but vLLM engines load HF weights; "
                "set it to the HF directory (the Megatron roles may load the Megatron checkpoint)"
            )
    roles = _role_keys(config)
    for key in [*roles, *engines[1:]]:
        role = config.at(key)
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
    _check_mtp(config)
    _check_speculative(config)


def lora(config: RunConfig) -> None:
    """LoRA's targets against the model, its router and expert-TP rules, adapter-only sync."""
    m = config.models
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
    _check_adapter_sync(config)


def roles(config: RunConfig) -> None:
    """Which roles take a reward model, shared-prompt rows per role."""
    rt, m = config.runtime_args, config.models
    n = m.policy.num_inference_per_prompt
    roles, engines = _role_keys(config), _engine_keys(config)
    if m.uses("reward_model"):
        path, bridge = m.reward_model.load, get_bridge(m.reward_model.load)
        if not bridge.value_model:
            names = sorted({b.value_architecture for b in BRIDGES.values() if b.value_architecture})
            raise ConfigError(
                f"models.reward_model.load={path!r}: {bridge.architecture} is no reward model; expected "
                f"a one-label sequence classifier, one of {names}"
            )
    for key in [*roles, *engines]:
        if key not in ("models.critic", "models.reward_model") and get_bridge(config.at(key).load).value_model:
            raise ConfigError(
                f"{key}.load={config.at(key).load!r}: a reward model (a score head, no LM head); it can start "
                "models.critic only, this role needs a causal LM"
            )
    for key in roles:
        role = config.at(key)
        if not role.share_prompts:
            continue
        bridge = get_bridge(role.load)
        mla, linear, window = bridge.multi_latent_attention, bridge.linear_attention, bridge.sliding_window
        if mla or linear or window or role.parallel.cp > 1:
            raise ConfigError(
                f"{key}.share_prompts: shared-prompt rows need whole rows per rank (parallel.cp="
                f"{role.parallel.cp}), rotary embeddings outside attention ({role.load!r} uses MLA: {mla}) and "
                f"attention that masks (linear attention: {linear}, sliding windows: {window}); set it to false"
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


def _check_weights(config: RunConfig) -> None:
    checked = set()
    for key in config.model_keys:
        path = config.at(key)
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


def load_tokenizer(key: str, path: str):
    """The tokenizer of the model directory ``path`` (the value of ``key``): where it does not load, or holds no
    token but its special ones, a ``ConfigError`` naming the key, on one line. (transformers 5 builds an empty
    tokenizer for some families, Qwen's among them, when the directory has no tokenizer files.)"""
    try:
        tokenizer = hf_load_tokenizer(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}={path!r}: its tokenizer does not load: {' '.join(str(err).split())}") from None
    if len(tokenizer.get_vocab()) <= len(tokenizer.all_special_tokens):
        raise ConfigError(
            f"{key}={path!r}: its tokenizer holds no token but its special ones {tokenizer.all_special_tokens}; "
            "expected the model's tokenizer files there (tokenizer.json, or a slow tokenizer's vocabulary)"
        )
    return tokenizer


def _vocabularies(config: RunConfig) -> None:
    """The teacher and the critic read the policy's token ids: their tokenizers must be the policy's."""
    m = config.models
    policy = None
    for role in ("teacher", "critic"):
        path = getattr(m, role).load
        if not m.uses(role) or path == m.policy.load:
            continue
        policy = policy or load_tokenizer("models.policy.load", m.policy.load).get_vocab()
        theirs = load_tokenizer(f"models.{role}.load", path).get_vocab()
        if theirs != policy:
            differ = sorted(set(theirs.items()) ^ set(policy.items()), key=str)[:3]
            raise ConfigError(
                f"models.{role}.load={path!r}: its tokenizer is not the policy's ({len(theirs)} tokens against "
                f"{len(policy)}; differing entries such as {differ}); the {role} must score the policy's token "
                "ids, so it needs the same vocabulary"
            )


def _check_chat_template(config: RunConfig, role: str) -> None:
    """The reward model and a judge of its own render what they read with their own tokenizer's chat
    template."""
    path = getattr(config.models, role).load
    template = load_tokenizer(f"models.{role}.load", path).chat_template
    if not template:
        raise ConfigError(
            f"models.{role}.load={path!r}: its tokenizer has no chat template, which what it reads is rendered "
            "with; add one (tokenizer_config.json or chat_template.jinja)"
        )


def _check_adapter_sync(config: RunConfig) -> None:
    """``models.policy.sync.lora: adapter``: the engines serve the policy's adapters with vLLM's LoRA."""
    m = config.models
    lora, key = m.policy_trainer.lora, "models.policy.sync.lora='adapter'"
    if m.policy.sync.lora != "adapter":
        return
    if not lora.rank:
        raise ConfigError(f"{key} syncs LoRA adapters, but models.policy_trainer.lora.rank is 0; set sync.lora: merged")
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


def _check_speculative(config: RunConfig) -> None:
    """``models.policy.rollout.speculative_tokens``: the engines draft with the model's MTP layers."""
    m = config.models
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


def _check_mtp(config: RunConfig) -> None:
    trainer = config.models.policy_trainer
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


def _check_model_dir(key: str, path: str) -> None:
    if not path:
        raise ConfigError(f"{key}: no model directory given (an HF directory with config.json)")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"{key}={path!r}: no config.json; expected an HF model directory or a converted Megatron checkpoint"
        )
