"""The hang watchdog (:mod:`mcore_rl.watchdog`) on real Ray actors: one hangs on purpose inside a phase, its peer
waits idle; the watchdog names the phase and the hung actor, writes both actors' stacks, and stops the run or
waits as configured. The hang never ends by itself, so no deadline here races the machine's load."""

import threading
import time

import pytest
import ray

from mcore_rl.config.loader import build
from mcore_rl.watchdog import HangError, Watchdog, WatchdogConfig, deadline, install_stack_dump


class Role:
    def __init__(self):
        install_stack_dump()

    def hang_in_a_collective(self):
        threading.Event().wait()  # the peer that never comes

    def step(self):
        return "done"


def _wait_for_report(watchdog: Watchdog, timeout: float = 300):
    start = time.monotonic()
    while watchdog.overdue is None:
        assert time.monotonic() - start < timeout, "the watchdog never reported"
        time.sleep(0.2)
    return watchdog.overdue


@pytest.mark.parametrize("action", ["stop", "wait"])
def test_the_watchdog_names_the_hung_actor_and_writes_every_stack(ray_address, tmp_path, action):
    role = ray.remote(Role)
    hung, idle = (
        role.options(name=f"watchdog-{action}-{r}", num_cpus=0).remote() for r in ("policy_trainer-0", "engine-0")
    )
    ray.get([hung.__ray_ready__.remote(), idle.__ray_ready__.remote()])
    # stop: an idle actor answers a no-op in milliseconds, well within ping_s (the one it kills is the silent one);
    # wait: nothing is killed whoever answers, so the hung actor's certain silence is all this test reads
    config = WatchdogConfig(limit_s=2, action=action, ping_s=10 if action == "stop" else 0.5)
    watchdog = Watchdog(config, tmp_path / "logs")
    try:
        with watchdog.phase("ref_logprobs", episode=1):  # a phase that ends in time is never reported
            assert ray.get(idle.step.remote()) == "done"
        with pytest.raises(ray.exceptions.RayActorError) as stopped, watchdog.phase("train", episode=3):
            call = hung.hang_in_a_collective.remote()
            if action == "wait":  # it reports, keeps waiting, and the user (here the test) decides
                _wait_for_report(watchdog)
                assert ray.wait([call], timeout=1)[0] == []  # still inside the call: the watchdog killed nothing
                ray.kill(hung)
            ray.get(call)
        report = watchdog.overdue
        assert (report.phase, report.episode) == ("train", 3) and f"watchdog-{action}-policy_trainer-0" in report.silent
        assert report.stacks == tmp_path / "logs" / "hang-3-train.txt"
        text = report.stacks.read_text()
        assert text.startswith(f"{report}\n")
        sections = {}  # actor name -> (its header line, its stacks), in whatever order the actors started
        for part in text.split("\n=== ")[1:]:
            header, _, stacks = part.partition(" ===\n")
            sections[header.split(" (pid")[0]] = (header, stacks)
        (hung_header, hung_part), (idle_header, idle_part) = (
            sections[f"watchdog-{action}-{r}"] for r in ("policy_trainer-0", "engine-0")
        )
        assert "NOT ANSWERING" in hung_header
        assert "hang_in_a_collective" in hung_part and "hang_in_a_collective" not in idle_part
        assert "Current thread" in idle_part or "Thread" in idle_part  # the idle actor's threads are there too
        if action == "stop":  # only the hung actor was silent, and only it was killed
            assert report.silent == ["watchdog-stop-policy_trainer-0"] and "NOT" not in idle_header
            assert ray.get(idle.step.remote()) == "done"
            with pytest.raises(HangError, match=r"phase 'train' of episode 3 has run \d+ s .*policy_trainer-0"):
                watchdog.raise_if_stopped(stopped.value)
        else:
            watchdog.raise_if_stopped(stopped.value)  # waiting: the run's own error stands
    finally:
        watchdog.close()
        ray.kill(idle)
        ray.kill(hung)


def test_a_phase_is_overdue_far_past_its_recent_times_or_past_the_limit():
    config = WatchdogConfig(factor=10, min_s=60)
    assert deadline(config, []) == 60  # an unseen phase: min_s
    assert deadline(config, [1.0, 2.0]) == 60
    assert deadline(config, [30.0, 12.0]) == 300  # the longest recent time, times the factor
    assert deadline(WatchdogConfig(factor=10, min_s=60, limit_s=100), [30.0]) == 100


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("factor", 0, r"runtime_args.watchdog.factor=0.0: expected a positive number"),
     ("limit_s", -1, r"runtime_args.watchdog.limit_s=-1.0: expected seconds >= 0"),
     ("action", "kill", r"runtime_args.watchdog.action='kill': expected one of \['wait', 'stop'\]")],
)  # fmt: skip
def test_watchdog_keys_are_checked(key, value, message):
    with pytest.raises(ValueError, match=message):
        build(WatchdogConfig, {key: value}, "runtime_args.watchdog").validate()
