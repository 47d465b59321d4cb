"""Eval numbers as practitioners report them: pass@k with the unbiased estimator of Chen et al. (2021, "Evaluating
Large Language Models Trained on Code", eq. 1) and mean@n (the mean accuracy of all n samples per prompt), per
named eval set, and the table of them the console and ``logs/driver.log`` show after each evaluation."""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn without replacement from ``n`` (``c`` of them
    correct) is correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks(n: int) -> list[int]:
    """The k reported for n samples per prompt: the powers of two below n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


def accuracy_metrics(correct: list[bool], n: int) -> dict[str, float]:
    """``accuracy`` (mean@n) and ``pass_at_<k>`` (pass@k; MLflow refuses '@' in names) of samples in prompt order,
    ``n`` per prompt."""
    if not correct or len(correct) % n:
        raise ValueError(f"{len(correct)} samples are no whole number of prompts of {n} samples")
    counts = [sum(correct[i : i + n]) for i in range(0, len(correct), n)]
    out = {"accuracy": sum(correct) / len(correct)}
    for k in ks(n):
        out[f"pass_at_{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
    return out


def eval_table(episode: int, metrics: dict[str, float], sets: list[str]) -> str:
    """The evaluation's table: one row per eval set (``""``: the main one, under ``eval/``; else ``eval/<set>/``),
    one column per number."""
    rows = []
    for name in sets:
        prefix = f"eval/{name}/" if name else "eval/"
        rows.append((name or "eval", {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)
                                      and "/" not in k[len(prefix) :]}))  # fmt: skip
    columns = list(dict.fromkeys(key for _, values in rows for key in values))
    width = max(len(name) for name, _ in rows)
    lines = [f"eval after episode {episode}:", "  ".join([" " * width, *(f"{c:>10}" for c in columns)])]
    for name, values in rows:
        cells = (f"{values[c]:>10.4g}" if c in values else " " * 10 for c in columns)
        lines.append("  ".join([f"{name:<{width}}", *cells]))
    return "\n".join(lines)
