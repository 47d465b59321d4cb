"""The Python sandbox (the python tool's and environment's) refuses the network, file access outside its directory and subprocesses, and stops code
at its time and memory limits; the code's own output and errors are the result."""

from __future__ import annotations

import socket
import time

from mcore_rl.agent.envs import PythonEnv
from mcore_rl.agent.sandbox import SandboxConfig, run_python
from mcore_rl.agent.tools import PythonTool, invoke
from mcore_rl.rewards.user import Reward

LIMITS = SandboxConfig(timeout_s=3, memory_mb=256)


def test_output_and_errors_are_the_result():
    assert run_python("import math, json\nprint(math.comb(10, 3), json.dumps([1]))", LIMITS) == "120 [1]\n"
    assert run_python("1/0", LIMITS).rstrip().endswith("ZeroDivisionError: division by zero")
    assert invoke(PythonTool(LIMITS), {"code": "print(sum(range(101)))"}) == "5050\n"
    long = run_python("print('x' * 5000)", SandboxConfig(max_output_chars=100))
    assert long.startswith("[...]") and len(long) == 105


def test_network_is_refused():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    for code in (
        f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
        f"import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",  # below the socket module
    ):
        assert "PermissionError: sandbox: socket." in run_python(code, LIMITS)
    try:
        server.accept()
        raise AssertionError("the sandboxed code reached the server")
    except TimeoutError:
        pass
    finally:
        server.close()


def test_files_only_inside_its_own_directory(tmp_path):
    outside = tmp_path / "outside.txt"
    inside = run_python("open('notes.txt', 'w').write('kept'); print(open('notes.txt').read())", LIMITS)
    assert inside == "kept\n"
    for code, event in (
        (f"open({str(outside)!r}, 'w').write('x')", "no access"),
        (f"open({str(outside)!r}, 'a')", "no access"),
        ("print(open('/etc/hostname').read())", "no access"),  # reads too
        ("import os; os.listdir('/')", "os.listdir outside"),
        (f"import os; os.remove({str(tmp_path)!r})", "os.remove outside"),
        ("import os; os.system('touch /tmp/x')", "os.system is not allowed"),
        ("import subprocess; subprocess.run(['ls'])", "subprocess.Popen is not allowed"),
        ("import ctypes; ctypes.CDLL(None)", "ctypes.dlopen is not allowed"),
    ):
        assert f"PermissionError: sandbox: {event}" in run_python(code, LIMITS), code
    assert not outside.exists()


def test_time_and_memory_limits_stop_the_code():
    start = time.monotonic()
    assert run_python("while True: pass", SandboxConfig(timeout_s=1)) == "error: timed out after 1 s"
    assert time.monotonic() - start < 5
    assert "MemoryError" in run_python("x = bytearray(1 << 30)", LIMITS)


def test_the_python_environment_runs_code_blocks_until_an_answer():
    env = PythonEnv(Reward("math"), LIMITS)
    opening = env.reset({"id": "q", "messages": [{"role": "user", "content": "What is 2**10?"}], "answer": "1024"})
    assert (
        opening[0] == {"role": "system", "content": PythonEnv.INSTRUCTIONS}
        and opening[1]["content"] == "What is 2**10?"
    )
    observation, reward, done = env.step({"role": "assistant", "content": "```python\nprint(2**10)\n```"})
    assert observation == [{"role": "user", "content": "Output:\n1024\n"}] and (reward, done) == (0.0, False)
    observation, reward, done = env.step({"role": "assistant", "content": "The answer is 1024."})
    assert (observation, reward, done) == ([], 1.0, True)
