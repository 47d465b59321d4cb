"""A pool of gloo ranks that lives for the whole test session.

Spawning ranks costs seconds of imports each (torch, Megatron-Core); keeping them alive and
re-initialising only Megatron's groups per case (``parallel.groups.init_parallel`` tears down the previous layout)
makes a multi-rank case cost what its work costs. Cases are module-level functions, sent by reference and run on
every rank.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import queue
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.transfer import tcp_store

CASE_TIMEOUT_S = 300
HANG_DUMP_S = 120  # a rank still busy after this prints its stack (stderr): hangs show where they are
PEER_GRACE_S = 20  # after one rank failed, how long the others get before the pool is restarted
THREADS_END_S = 30  # how long a destroyed group's gloo threads get to end (a leaked group's never do)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STORE_TIMEOUT = timedelta(minutes=30)


def _worker(rank: int, world: int, port: int, repo: str, tasks, results) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a killed test session takes its ranks with it
    sys.path.insert(0, repo)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from compat.megatron_core import install_fixes
    from parallel.groups import destroy_parallel, gloo_connects_on_first_use

    torch.set_num_threads(1)
    install_fixes(cpu=True)
    gloo_connects_on_first_use()  # as a role's ranks (parallel.groups.init_parallel)
    store = tcp_store(("127.0.0.1", port), world, False, STORE_TIMEOUT)  # hosted by the pool (RankPool._start)
    dist.init_process_group("gloo", store=dist.PrefixStore("join0", store), rank=rank, world_size=world)

    dist.barrier()  # the default group starts its loops on its first collective: count them in the baseline
    baseline = _gloo_threads()
    # What is alive now (the imported modules) lives as long as the rank: the collections after each case and
    # layout change need not scan it again. So does what a case leaves alive once its groups are destroyed and
    # collected (the modules it imported, caches): frozen after each case, a collection scans only what the next
    # case makes (measured: test_bridges' collections 17 -> 1.2 s of CPU per rank).
    gc.freeze()
    while (task := tasks.get()) is not None:
        fn, kwargs = task
        if fn is _rejoin:
            kwargs = {**kwargs, "store": store}
        faulthandler.dump_traceback_later(HANG_DUMP_S)
        try:
            ok, value = True, fn(**kwargs)
        except BaseException:  # noqa: BLE001 - the traceback travels to the test process
            ok, value = False, traceback.format_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
            destroy_parallel()
        gc.collect()
        gc.freeze()
        libc.malloc_trim(0)  # hand the case's freed heap back: four long-lived ranks must not hold their peaks
        if ok and (left := _threads_left(baseline)) > 0:  # a leaked group costs every later case its threads
            ok, value = False, f"{fn.__name__} left {left} gloo threads: destroy the process groups it creates"
        results.put((rank, ok, value))
    gc.unfreeze()
    dist.destroy_process_group()


def _rejoin(join: int, store) -> None:
    """Replace the default group by a fresh one under the store's prefix ``join<join>``: what a failed case left
    unmatched in the old one is gone, and the new one's rendezvous keys cannot meet the old one's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"join{join}", store), rank=rank, world_size=world)
    dist.barrier()


def _threads_left(baseline: int) -> int:
    """Gloo threads above ``baseline`` once those of destroyed groups have ended: their loops exit on their own,
    later on a loaded machine (seen: one still running as the case returned)."""
    deadline = time.monotonic() + THREADS_END_S
    while (left := _gloo_threads() - baseline) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _gloo_threads() -> int:
    """This process's gloo threads (Linux): a process group's loops live until the group is destroyed and freed."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().startswith(("pt_gloo", "gloo"))
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return count


class RankPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        # The pool hosts its ranks' store: its port is held from the choice on, while the ranks take seconds to
        # import (a port chosen and let go was once taken meanwhile: EADDRINUSE at a rank's bind).
        self.store, self.joins = tcp_store(("127.0.0.1", 0), self.world_size, True, STORE_TIMEOUT), 0
        port = self.store.port
        # Not daemonic: Megatron's checkpoint writer starts a multiprocessing manager, which daemons may not.
        # ``close`` (the session fixture's teardown) ends them.
        self.procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, repo, self.tasks[r], self.results))
            for r in range(self.world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, **kwargs) -> list:
        """Run ``fn(**kwargs)`` on every rank; returns the per-rank results or raises with the failing traceback.

        A rank that fails may leave its peers waiting in a collective: after the first failure the others get
        ``PEER_GRACE_S`` to finish. If every rank answered, they all join a fresh default group (a collective one
        of them skipped must not pair with the next case's); otherwise the pool is restarted.
        """
        out, errors, answered = self._run(fn, kwargs)
        if errors:
            self.joins += 1
            if not answered or self._run(_rejoin, {"join": self.joins})[1]:
                self.close()
                self._start()
            raise RuntimeError("\n".join(errors))
        return out

    def _run(self, fn, kwargs) -> tuple[list, list[str], bool]:
        """(per-rank results, errors, whether every rank answered)."""
        for q in self.tasks:
            q.put((fn, kwargs))
        out, errors, pending = [None] * self.world_size, [], self.world_size
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while pending:
            try:
                rank, ok, value = self.results.get(timeout=1)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
                if dead:  # a rank that died (at start-up, or killed) never answers: say so now
                    errors.append(f"rank(s) exited with codes {dead} (their tracebacks are on stderr)")
                    break
                if time.monotonic() > deadline:
                    errors.append(f"{pending} rank(s) did not finish (see their stacks on stderr)")
                    break
                continue
            pending -= 1
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        return out, errors, not pending

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
