"""The ``lm_head`` suite: peak memory and time of the LM head and the policy loss's log-probs and entropy (forward and
backward) over a micro-batch of 4k, 16k and 32k tokens, before (the whole micro-batch's fp32 softmax:
:mod:`tests.lm_head_reference`) and after chunking (:func:`mcore_rl.trainer.logprobs.token_scores`).

Hidden states [tokens, hidden] and the output layer's weight [V, hidden] in the machine's parameter dtype (bf16 on
GPUs, fp32 on CPUs) are made first, then the peak above them is read over logits = hidden @ W^T, the scores and the
backward of -mean log p (entropy logged) or of -mean log p - 0.01 mean H (an entropy bonus): on CUDA the
allocator's peak, in this process; on CPU the peak resident set of a process of its own per measurement. A size
where "before" or "after" would not fit in 80 % of the free memory is reported as not run for it, and the other
measured where it fits: the chunked head at lengths the unchunked one cannot reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import free_port
from benchmarks.report import Report, table
from mcore_rl.trainer.logprobs import LM_HEAD_CHUNK_BYTES as CHUNK

TOKENS = (4096, 16384, 32768)
# (name, vocabulary, hidden): SmolLM2-135M's untied 49,152 entries, Qwen3's 151,936 at Qwen3-8B's hidden size.
HEADS = (("SmolLM2-135M", 49152, 576), ("Qwen3-8B", 151936, 4096))
BEFORE_BYTES = 22  # per logit, the unchunked peak: the logits, a fp32 copy, the entropy's fp32 copy and temporaries
AFTER_BYTES = 11  # per logit, the chunked peak: the logits, their gradient and the chunks (8.4-10.8 measured)
REPO = Path(__file__).resolve().parents[1]


def _world():
    """This process as one rank (TP 1): the TP group the scores reduce over."""
    from benchmarks import single_process_world
    from parallel.config import ParallelConfig
    from parallel.groups import init_parallel

    single_process_world()
    return init_parallel(ParallelConfig()).tp


def _one(spec: dict, tp_group) -> dict:
    """One measurement, in this process (see the module's docstring); ``chunk_bytes``: the chunks' size, if not
    the trainer's."""
    import psutil

    from mcore_rl.trainer.logprobs import token_scores
    from parallel.device import Device
    from tests.lm_head_reference import unchunked_scores

    machine = Device.current()
    device, dtype = torch.device("cuda" if machine.cuda else "cpu"), machine.params_dtype
    generator = torch.Generator(device=device).manual_seed(0)
    tokens, vocab, hidden = spec["tokens"], spec["vocab"], spec["hidden"]
    h = (torch.randn(tokens, hidden, device=device, generator=generator, dtype=dtype) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=generator, dtype=dtype) / hidden**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    bonus = spec["entropy_bonus"]
    if machine.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # the peak resident set from here on: Linux resets VmHWM on "5" to clear_refs
        Path("/proc/self/clear_refs").write_text("5")
        base = psutil.Process().memory_info().rss
    start = time.perf_counter()
    logits = h @ w.T
    if spec["mode"] == "before":
        logp, entropy = unchunked_scores(logits, targets, vocab, tp_group, entropy_grad=bonus)
    else:
        logp, entropy = token_scores(logits, targets, vocab, tp_group, chunk_bytes=spec.get("chunk_bytes", CHUNK))
    entropy = entropy if bonus else entropy.detach()
    del logits  # the loss function's reference to the model output ends with it
    (-logp.mean() - (0.01 * entropy.mean() if bonus else 0.0)).backward()
    if machine.cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss() - base
    return {"peak_bytes": peak, "seconds": time.perf_counter() - start}


def _peak_rss() -> int:
    """This process's peak resident set since the last reset (VmHWM)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _free_bytes() -> int:
    import psutil

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return psutil.virtual_memory().available


def _measure(spec: dict) -> dict | str:
    """:func:`_one` (on CPU in a fresh process: its peak is its own): the result, or why there is none."""
    if torch.cuda.is_available():
        try:
            return _one(spec, _world())
        except torch.OutOfMemoryError as err:
            return f"out of memory: {str(err).splitlines()[0]}"
    env = os.environ | {"MASTER_PORT": str(free_port())}  # not the port of a world this process may hold
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.lm_head", json.dumps(spec)], cwd=REPO, env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    if run.returncode != 0:
        return f"failed (exit {run.returncode}): {run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ''}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def _measure_if_fits(spec: dict, need: int, free: int) -> dict | str:
    """:func:`_measure` where about ``need`` bytes fit in 80 % of the ``free`` ones, else why it did not run."""
    if need > 0.8 * free:
        return f"not run: needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
    return _measure(spec)


def suite(out: Path, hardware, report: Report) -> None:
    from parallel.device import Device

    free, rows = _free_bytes(), []
    dtype_bytes = Device.current().params_dtype.itemsize  # the inputs' dtype, as _one makes them
    for name, vocab, hidden in HEADS:
        for tokens in TOKENS:
            for bonus in (False, True):
                spec = dict(tokens=tokens, vocab=vocab, hidden=hidden, entropy_bonus=bonus)
                inputs = (tokens + vocab) * hidden * dtype_bytes * 2  # and their gradients
                before = _measure_if_fits(spec | {"mode": "before"}, tokens * vocab * BEFORE_BYTES + inputs, free)
                after = _measure_if_fits(spec | {"mode": "after"}, tokens * vocab * AFTER_BYTES + inputs, free)
                gib = [f"{r['peak_bytes'] / 2**30:.2f}" if isinstance(r, dict) else r for r in (before, after)]
                seconds = [f"{r['seconds']:.3f}" if isinstance(r, dict) else "" for r in (before, after)]
                less = (
                    f"{before['peak_bytes'] / after['peak_bytes']:.1f}x"
                    if isinstance(before, dict) and isinstance(after, dict)
                    else ""
                )
                rows.append([name, tokens, "bonus" if bonus else "logged", *gib, less, *seconds])
    report.add(
        "lm_head: the loss's log-probs and entropy, unchunked and chunked",
        f"Peak memory above the hidden states and the output layer's weight ({hardware.device}, "
        f"{hardware.matmul_dtype}), over logits = hidden @ W^T, log-probs and entropy and the backward of the "
        "policy loss's part of them: with the entropy only logged (the default) or optimised (an entropy bonus). "
        "Seconds: that forward and backward, once. Before: the whole micro-batch's fp32 softmax "
        "(tests/lm_head_reference.py); after: chunks of 256 MiB of fp32 (mcore_rl/trainer/logprobs.py).",
        table(
            ["head", "tokens", "entropy", "before GiB", "after GiB", "less", "before s", "after s"],
            rows,
        ),
    )


if __name__ == "__main__":
    print(json.dumps(_one(json.loads(sys.argv[1]), _world())))
