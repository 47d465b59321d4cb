"""The embedded real model (SmolLM2-135M-Instruct): Megatron greedy-decodes what HF transformers decodes, a sync
changes the engine's output exactly as Megatron's, and an agent with the unmodified ``openai`` client drives a
tool-using episode through the agent endpoint, recorded token for token as the engine sampled it."""

import json

import openai
import pytest
import ray
import torch
import transformers

from converters.gguf2hf import default_model_dir
from mcore_rl.agent.chat import HERMES_SYSTEM, ChatFormat
from mcore_rl.agent.server import AgentServer
from mcore_rl.agent.sessions import EngineCalls, Sessions
from mcore_rl.agent.tools import Calculator, invoke, schema
from mcore_rl.data.arithmetic import arithmetic_splits
from mcore_rl.roles.rollout import RolloutGroup
from mcore_rl.rollout.engine import MultiTurnConfig, RolloutConfig, SamplingConfig
from mcore_rl.rollout.remote import launch_engine, stop_engine
from tests.distributed import cases

PROMPT = "The capital of France is"
NEW_TOKENS = 8
MAX_LEN = 1024  # the Hermes instructions alone are about 230 of SmolLM2's tokens


@pytest.fixture(scope="module")
def engine(ray_address):
    """One SmolLM2 engine for the module: the agent's episode, then the sync's perturbed weights."""
    config = RolloutConfig(max_model_len=MAX_LEN, cpu_kv_cache_bytes=96 << 20)
    engine = launch_engine(default_model_dir(), config, name="smollm2")
    yield engine
    stop_engine(engine)


def test_smollm2_greedy_matches_hf_at_tp1_and_tp3(ranks, ranks3):
    model_dir = default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer(PROMPT)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(expected)
    # 9 query / 3 KV heads: TP must divide 3, so TP=2 is refused up front (next test) and TP=3 runs on 3 ranks.
    for pool, layout in ((ranks, dict(tp=1)), (ranks3, dict(tp=3))):
        for got in pool.run(
            cases.greedy, hf_dir=str(model_dir), layout=layout, prompt_ids=prompt, new_tokens=NEW_TOKENS
        ):
            assert got[: len(expected)] == expected, (layout, tokenizer.decode(got), tokenizer.decode(expected))


def test_smollm2_tp2_is_refused_with_the_fix(ranks):
    with pytest.raises(
        RuntimeError, match=r"num_attention_heads=9 is not divisible by tp=2; choose tp among \[1, 3\]\n"
    ):
        ranks.run(cases.greedy, hf_dir=str(default_model_dir()), layout=dict(tp=2), prompt_ids=[1], new_tokens=1)


# Beside the sync test, whose rank pool puts it in the "ranks" group (tests/conftest.py): one engine for both.
@pytest.mark.xdist_group("ranks")
def test_an_openai_client_drives_a_tool_using_smollm2_episode_recorded_token_for_token(engine):
    """SmolLM2 calls no tool well-formed of itself (its template has no tools; the benchmark's agent runs show it),
    so the agent opens the episode with the history of a calculator round it ran: its question, the call, the
    result. The endpoint renders that history with SmolLM2's template, the tools' Hermes instructions and the call in
    the assistant turn; the policy answers, the agent asks again, the policy answers again. The trajectory holds the
    turns the client got, token for token with their log-probs, which are the engine's own at their places."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    rollout, tools = RolloutGroup([engine], tp=1), [schema(Calculator())]
    calls = EngineCalls(rollout)
    server = AgentServer(Sessions(calls, tokenizer, MultiTurnConfig(max_turns=3), MAX_LEN - 1, "policy"))
    row = arithmetic_splits(1, 0, seed=6)[0][0]
    arguments = json.dumps({"expression": row.messages[-1]["content"].split("?")[0].removeprefix("What is ")})
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    result = invoke(Calculator(), json.loads(arguments))  # the agent ran the tool itself
    history = [*row.messages, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_0", "content": result}]  # fmt: skip
    try:
        server.sessions.open("smollm2", row.as_dict(), SamplingConfig(temperature=1.0, max_new_tokens=24, seed=3))
        client = openai.OpenAI(base_url=server.base_url("smollm2"), api_key=server.token, max_retries=0, timeout=600)
        replies = []
        for follow_up in ("", "Are you sure? Say it once more."):
            if follow_up:
                history += [replies[-1].message, {"role": "user", "content": follow_up}]
            replies.append(
                client.chat.completions.create(
                    model="policy", messages=history, tools=tools, logprobs=True, extra_body={"return_token_ids": True}
                ).choices[0]
            )
        traj, _ = server.sessions.finish("smollm2")
    finally:
        server.close()
        calls.close()

    # the opening: the Hermes instructions, the question, the agent's call as Hermes's <tool_call>, its result
    hermes_call = f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'
    opening = [
        {"role": "system", "content": HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))},
        *row.messages,
        {"role": "assistant", "content": hermes_call},
        {"role": "tool", "content": result},
    ]
    assert traj.prompt_ids == tokenizer.apply_chat_template(opening, add_generation_prompt=True, return_dict=False)
    # the sampled turns are what the client got, token for token with their log-probs ...
    turns = [r.model_extra["token_ids"] for r in replies]
    assert all(turns) and traj.turns == 2
    assert [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m] == turns[0] + turns[1]
    got = [lp for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m]
    assert got == [t.logprob for r in replies for t in r.logprobs.content]
    # ... with the agent's question between them as the template puts it after the first turn, masked
    between = ChatFormat(tokenizer, tools).observation([history[-1]], turns[0])
    assert traj.token_ids == turns[0] + between + turns[1]
    assert traj.loss_mask == [1] * len(turns[0]) + [0] * len(between) + [1] * len(turns[1])
    # each sampled token's log-prob is the engine's at its place in the whole sequence
    scored = ray.get(engine.score.remote([traj.prompt_ids + traj.token_ids]))[0][len(traj.prompt_ids) - 1 :]
    for logp, engine_logp, mask in zip(traj.logprobs, scored, traj.loss_mask, strict=True):
        assert abs(logp - engine_logp) <= 1e-4 if mask else logp == 0.0
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]


def test_smollm2_sync_changes_engine_output_exactly_as_megatron(ranks3, engine, ray_address):
    """Load, generate, perturb the weights in Megatron (TP=3), sync: the engine now decodes what Megatron does."""
    model_dir = default_model_dir()
    prompt = transformers.AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS)
    engine_before = ray.get(engine.generate.remote([prompt], greedy))[0][0].token_ids
    results = ranks3.run(
        cases.perturb_and_sync,
        hf_dir=str(model_dir),
        layout=dict(tp=3),
        ray_address=ray_address,
        engine_name="smollm2",
        prompt_ids=prompt,
        new_tokens=NEW_TOKENS,
    )
    engine_after = ray.get(engine.generate.remote([prompt], greedy))[0][0].token_ids
    megatron = results[0]
    assert engine_before == megatron["before"]
    assert megatron["after"] != megatron["before"], "the perturbation did not change Megatron's greedy output"
    assert engine_after == megatron["after"]
    # Random probe tokens get log-probs down to about -30 from a 135M model: 1e-3 is ~3e-5 relative (fp32).
    assert megatron["report"]["probe_max_abs_diff"] <= 1e-3
