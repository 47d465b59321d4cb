"""The python tool and environment run code in the sandbox: the code's own output and errors are the result
(what the sandbox keeps out is tests/security/test_sandbox_escapes.py)."""

from __future__ import annotations

import pytest

from mcore_rl.agent.envs import PythonEnv
from mcore_rl.agent.sandbox import Sandbox, SandboxConfig
from mcore_rl.agent.tools import PythonTool, invoke
from mcore_rl.rewards.user import Reward


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox.start(SandboxConfig(timeout_s=30, memory_mb=256))


def test_output_and_errors_are_the_result(sandbox):
    assert sandbox.run("import math, json\nprint(math.comb(10, 3), json.dumps([1]))") == "120 [1]\n"
    assert sandbox.run("1/0").rstrip().endswith("ZeroDivisionError: division by zero")
    assert invoke(PythonTool(sandbox), {"code": "print(sum(range(101)))"}) == "5050\n"
    long = Sandbox(SandboxConfig(max_output_chars=100), sandbox.required).run("print('x' * 5000)")
    assert long.startswith("[...]") and len(long) == 105
    assert sandbox.run("import sys; sys.stdout.write('out '); sys.stdout.flush(); sys.stderr.write('err')") == "out err"


def test_the_python_environment_runs_code_blocks_until_an_answer(sandbox):
    env = PythonEnv(Reward("math"), sandbox)
    opening = env.reset({"id": "q", "messages": [{"role": "user", "content": "What is 2**10?"}], "answer": "1024"})
    assert (
        opening[0] == {"role": "system", "content": PythonEnv.INSTRUCTIONS}
        and opening[1]["content"] == "What is 2**10?"
    )
    observation, reward, done = env.step({"role": "assistant", "content": "```python\nprint(2**10)\n```"})
    assert observation == [{"role": "user", "content": "Output:\n1024\n"}] and (reward, done) == (0.0, False)
    observation, reward, done = env.step({"role": "assistant", "content": "The answer is 1024."})
    assert (observation, reward, done) == ([], 1.0, True)


def test_the_python_environment_runs_a_bounded_number_of_blocks(sandbox):
    env = PythonEnv(Reward("math"), sandbox)
    env.reset({"id": "q", "messages": [{"role": "user", "content": "?"}], "answer": "1"})
    blocks = "".join(f"```python\nprint({i})\n```" for i in range(1000))
    (observation,), reward, done = env.step({"role": "assistant", "content": blocks})
    assert observation["content"] == "Output:\n0\n\n1\n\n2\n\n3\n\nerror: only the first 4 code blocks of a message run"
    assert (reward, done) == (0.0, False)
