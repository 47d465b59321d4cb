"""The ``sandbox`` suite: what the kernel isolation of the policy's code costs.

- start-up: :meth:`Sandbox.start` (the probe that finds the kernel's layers), once per tool or environment actor;
- per call: the latency of a trivial program and of a CPU-bound one, confined, against the same child interpreter
  unconfined (``python -I -S -c``, output to a file as the sandbox's): the difference is the isolation's cost;
- throughput: python tool calls per second through the agent loop's tool pool (4 actors, as
  ``models.reward.tool_actors`` defaults), the sandboxed ``python`` tool against a user tool that runs the same
  unconfined child interpreter.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from benchmarks.report import Report, table
from mcore_rl.agent.sandbox import Sandbox, SandboxConfig

PROGRAMS = {
    "trivial": "print(1)",
    "cpu-bound": "print(sum(i for i in range(2, 300000) if all(i % d for d in range(2, 7))))",
}
CALLS = 64
ACTORS = 4

# The unconfined baseline as a user tool (the same child interpreter, no kernel layers).
BARE_TOOL = """
import subprocess, sys, tempfile


def bare(code: str) -> str:
    with tempfile.TemporaryFile() as out:
        subprocess.run([sys.executable, "-I", "-S", "-c", code], stdout=out, stderr=out, env={}, timeout=60)
        out.seek(0)
        return out.read().decode("utf-8", "replace")


class Bare:
    name = "bare"
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def call(self, arguments):
        return bare(arguments["code"])
"""


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _calls_per_s(spec: str, sandbox: SandboxConfig) -> float:
    from mcore_rl.agent.actors import ToolPool
    from mcore_rl.agent.tool_calls import ToolCall

    pool = ToolPool([spec], sandbox, ACTORS, timeout_s=60, max_chars=8192)
    name = "python" if spec == "python" else "bare"
    try:
        for i in range(ACTORS):  # warm: every actor started and its sandbox probed
            pool.submit(("warm", i), ToolCall(name, {"code": PROGRAMS["trivial"]}))
        while sum(1 for t, _ in pool.poll(0.2) if t[0] == "warm") < ACTORS and pool.busy:
            pass
        start, done = time.perf_counter(), 0
        for i in range(CALLS):
            pool.submit(("call", i), ToolCall(name, {"code": PROGRAMS["trivial"]}))
        while done < CALLS:
            results = pool.poll(0.05)
            assert not any(r.error for _, r in results), [r.text for _, r in results]
            done += len(results)
        return CALLS / (time.perf_counter() - start)
    finally:
        pool.stop()


def suite(out: Path, hardware, report: Report) -> None:
    del hardware
    import ray

    config = SandboxConfig(timeout_s=60)
    startup_ms = _median_ms(lambda: Sandbox.start(config), 10)
    sandbox = Sandbox.start(config)
    tools_file = out / "bare_tool.py"
    tools_file.write_text(BARE_TOOL)
    sys.path.insert(0, str(out))
    from bare_tool import bare  # noqa: E402 - the file just written

    rows = []
    for name, code in PROGRAMS.items():
        confined, unconfined = _median_ms(lambda c=code: sandbox.run(c), 20), _median_ms(lambda c=code: bare(c), 20)
        rows.append([name, f"{unconfined:.1f}", f"{confined:.1f}", f"{confined - unconfined:+.1f}"])
    started = not ray.is_initialized()
    if started:
        from compat.ray import start_local_cluster

        start_local_cluster(num_cpus=2, log_to_driver=False)
    try:
        sandboxed = _calls_per_s("python", config)
        unconfined = _calls_per_s(f"{tools_file}:Bare", config)
    finally:
        if started:
            ray.shutdown()
    report.add(
        "sandbox: the kernel isolation's cost",
        f"Layers: {', '.join(sandbox.required)}. Start-up (the probe, once per tool or environment actor): "
        f"{startup_ms:.1f} ms (median of 10).",
        "Per call, median of 20 (ms): the unconfined child interpreter against the sandbox.",
        table(["program", "unconfined", "sandboxed", "isolation"], rows),
        f"Python tool calls per second through the tool pool ({ACTORS} actors, {CALLS} calls of `print(1)`): "
        f"unconfined {unconfined:.1f}, sandboxed {sandboxed:.1f} ({100 * (sandboxed / unconfined - 1):+.1f}%).",
    )
