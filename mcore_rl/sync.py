"""Trainer -> rollout weight sync, in memory, verified by a log-prob probe after every sync.

Every trainer rank runs :func:`converters.stream.export_hf` (its collectives need all ranks) and gets the whole
model. The ranks on a rollout engine's devices regroup the HF tensors into byte buckets and pack each into a
buffer on their own device (:mod:`mcore_rl.rollout.transport`); the first of them (the owner) streams one handle
per bucket, naming every copy, to the engine, whose worker on each device maps the copy on it. Two buffers
alternate, so packing bucket k+1 overlaps the engine loading bucket k. Afterwards the engine scores a fixed probe
batch and its log-probs are compared with the trainer's, scored before the push (so the trainer's weights may
leave the device before the engine's KV cache returns): stale or corrupted weights fail loudly here instead of
silently skewing the policy gradient.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import ray
import torch

from converters.stream import export_hf
from mcore_rl.rollout.transport import BucketSender
from mcore_rl.training import MegatronModel
from parallel.comm import all_gather_objects, all_reduce_scalar
from parallel.groups import block_group

log = logging.getLogger(__name__)

# Defaults of the probe's tolerances by engine dtype: (max |Δ|, mean |Δ|) of per-token log-probs.
PROBE_TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (1.0, 5e-2), torch.float16: (1.0, 5e-2)}


@dataclass
class SyncConfig:
    # 64 MiB measured fastest on CPU (more overlap of packing with the engine's loading than 512 MiB, see
    # benchmarks/reports); larger buckets mean fewer round trips on GPU.
    bucket_bytes: int = 64 << 20
    probe: bool = True  # score the probe batch after every sync
    probe_sequences: int = 4
    probe_length: int = 32
    probe_seed: int = 0
    probe_max_tolerance: float | None = None  # None: by engine dtype, see PROBE_TOLERANCE
    probe_mean_tolerance: float | None = None

    def validate(self, prefix: str = "sync") -> None:
        """Errors name each field under ``prefix`` (the run config's ``models.policy.sync``)."""
        if self.bucket_bytes <= 0:
            raise ValueError(f"{prefix}.bucket_bytes={self.bucket_bytes}: expected a positive number of bytes")
        if self.probe and (self.probe_sequences < 1 or self.probe_length < 2):
            raise ValueError(
                f"{prefix}.probe_sequences={self.probe_sequences}, {prefix}.probe_length={self.probe_length}: "
                f"expected {prefix}.probe_sequences >= 1 and {prefix}.probe_length >= 2"
            )


@dataclass(frozen=True)
class SyncReport:
    index: int  # 0 for the first sync (buffers allocated), then 1, 2, ...
    seconds: float
    engine_wait_seconds: float  # of ``seconds``, time the owner rank waited for the engine to take buckets in
    bytes: int
    buckets: int
    probe_max_abs_diff: float | None
    probe_mean_abs_diff: float | None
    repairs: tuple[str, ...]

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else math.inf


class ProbeMismatchError(RuntimeError):
    """The rollout engine's log-probs after a sync disagree with the trainer's beyond the tolerance."""


def probe_tokens(vocab_size: int, config: SyncConfig) -> torch.Tensor:
    """The fixed probe batch: seeded uniform token ids, the same on every rank and every sync."""
    generator = torch.Generator().manual_seed(config.probe_seed)
    return torch.randint(0, vocab_size, (config.probe_sequences, config.probe_length), generator=generator)


def send_buckets(named: Iterator[tuple[str, torch.Tensor]], budget: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The exported HF tensors grouped into what the engine loads at once: at most ``budget`` bytes (or one)."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > budget:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _waited(refs) -> float:
    start = time.perf_counter()
    ray.get(refs)
    return time.perf_counter() - start


class WeightSync:
    """Streams a trainer's weights into its rollout engine (a Ray actor of ``RolloutEngine``) and checks them.

    Engines sit on blocks of ``engine_tp`` consecutive ranks (one engine worker per device); ``engine`` is the
    engine of this rank's block, or None where the block has none (those ranks still take part in the export's
    collectives). ``scorer`` is the trainer's model (or the train step wrapping it); its ``logprobs`` scores the
    probe batch on the trainer side (a collective on all ranks). Collective: all ranks construct it.
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        bridge,
        groups,
        engine,
        scorer: MegatronModel,
        config: SyncConfig,
        engine_dtype: torch.dtype,
        engine_tp: int = 1,
    ):
        config.validate()
        self.chunks, self.bridge, self.groups, self.engine = chunks, bridge, groups, engine
        self.feeders = block_group(engine_tp)  # the ranks feeding one engine (gloo: they exchange handles)
        self.owner = engine is not None and (self.feeders is None or torch.distributed.get_rank(self.feeders) == 0)
        self.scorer = scorer
        self.config = config
        default_max, default_mean = PROBE_TOLERANCE[engine_dtype]
        self.max_tolerance = config.probe_max_tolerance if config.probe_max_tolerance is not None else default_max
        self.mean_tolerance = config.probe_mean_tolerance if config.probe_mean_tolerance is not None else default_mean
        device = next(chunks[0].parameters()).device
        # Two buffers (pack one while the engine loads the other), only where an engine is fed.
        self.senders = [BucketSender(device, config.bucket_bytes) for _ in range(2 if engine is not None else 0)]
        self.probe_batch = probe_tokens(bridge.vocab_size, config).to(device)
        self.count = 0  # pushes so far
        self._pushed: SyncReport | None = None  # the last push, until ``verify`` completes it
        self._trainer_logprobs: torch.Tensor | None = None  # of the probe batch, at the last push

    def sync(self) -> SyncReport:
        """``push``, then ``verify``: for callers whose trainer weights stay on the device."""
        self.push()
        return self.verify()

    def push(self) -> SyncReport:
        """Load the current weights into the engines, whose KV caches stay asleep. Collective over all ranks.

        The trainer scores the probe batch first, while its weights are on the device, so that they can leave
        before ``verify`` wakes the engines' KV caches: the two never meet on the device.
        """
        start = time.perf_counter()
        nbytes = buckets = 0
        wait = 0.0
        repairs: tuple[str, ...] = ()
        self._trainer_logprobs = self._score() if self.config.probe else None
        exported = export_hf(self.chunks, self.bridge, self.groups, bucket_bytes=self.config.bucket_bytes)
        if self.engine is None:
            for _ in exported:
                pass
        else:
            if self.owner:
                ray.get(self.engine.begin_weight_update.remote())
            pending: list = [None, None]  # the engine's load in flight from each buffer
            for i, bucket in enumerate(send_buckets(exported, self.config.bucket_bytes)):
                slot = i % 2
                if self.owner and pending[slot] is not None:
                    wait += _waited(pending[slot])  # the engine is done with this buffer...
                if self.feeders is not None:
                    torch.distributed.barrier(group=self.feeders)  # ...on every feeder's device
                handle = self.senders[slot].pack(bucket)
                if self.feeders is not None:  # every copy of bucket i is packed once this returns
                    copies = all_gather_objects(handle.buffers, self.feeders)
                    handle = dataclasses.replace(handle, buffers=tuple(ref for refs in copies for ref in refs))
                if self.owner:  # queued behind the load of bucket i-1, which may still run
                    pending[slot] = self.engine.load_bucket.remote(handle)
                nbytes += handle.nbytes
                buckets += 1
            if self.owner:
                wait += _waited([p for p in pending if p is not None])
                wait += _waited(finish := self.engine.finish_weight_update.remote())
                repairs = tuple(ray.get(finish))
        self._pushed = SyncReport(self.count, time.perf_counter() - start, wait, nbytes, buckets, None, None, repairs)
        self.count += 1
        return self._pushed

    def verify(self) -> SyncReport:
        """Wake the engines' KV caches and (by default) compare their log-probs of the probe batch with the
        trainer's from ``push``; the last push's report, completed with the differences. Collective over all ranks.
        """
        pushed, self._pushed = self._pushed, None
        if pushed is None:
            raise RuntimeError("WeightSync.verify: nothing pushed since the last verify (call push first)")
        if self.owner:
            ray.get(self.engine.wake_up.remote())
        report = pushed
        if self._trainer_logprobs is not None:
            max_diff, mean_diff = self._compare(self._trainer_logprobs, f"after weight sync {pushed.index}")
            report = dataclasses.replace(pushed, probe_max_abs_diff=max_diff, probe_mean_abs_diff=mean_diff)
        if self.owner:
            log.info(
                "weight sync %d: %.3f s, %.1f MB in %d buckets (%.2f GB/s), probe max|Δ| %s mean|Δ| %s",
                report.index, report.seconds, report.bytes / 1e6, report.buckets, report.gb_per_s,
                report.probe_max_abs_diff, report.probe_mean_abs_diff,
            )  # fmt: skip
        return report

    def probe(self) -> tuple[float, float]:
        """The engines' log-probs of the probe batch against the trainer's, now (both must hold their weights and
        the engines be awake); all ranks raise ``ProbeMismatchError`` above tolerance."""
        return self._compare(self._score(), "now")

    def _score(self) -> torch.Tensor:
        """The trainer's log-probs of the probe batch (a collective on all ranks)."""
        return self.scorer.logprobs(
            self.probe_batch, self.bridge.vocab_size, micro_batch_size=len(self.probe_batch)
        ).cpu()

    def _compare(self, trainer: torch.Tensor, when: str) -> tuple[float, float]:
        max_diff = mean_diff = 0.0
        if self.owner:
            engine = torch.tensor(ray.get(self.engine.score.remote(self.probe_batch.tolist())), dtype=torch.float32)
            diff = (engine - trainer).abs()
            max_diff, mean_diff = diff.max().item(), diff.mean().item()
        # The worst engine decides, on every rank, so that all ranks raise together or none does.
        max_diff = all_reduce_scalar(max_diff, torch.distributed.group.WORLD, "max")
        mean_diff = all_reduce_scalar(mean_diff, torch.distributed.group.WORLD, "max")
        if not (max_diff <= self.max_tolerance and mean_diff <= self.mean_tolerance):
            raise ProbeMismatchError(
                f"{when}, rollout log-probs differ from the trainer's: max |Δ| {max_diff:.3g} "
                f"(tolerance {self.max_tolerance:g}), mean |Δ| {mean_diff:.3g} (tolerance {self.mean_tolerance:g}); "
                "the engine holds stale or mis-converted weights (set models.policy.sync.probe_max_tolerance/"
                "probe_mean_tolerance only if the difference is expected numerics)"
            )
        return max_diff, mean_diff

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
        if self.feeders is not None:
            torch.distributed.destroy_process_group(self.feeders)
            self.feeders = None
