"""Trainer -> rollout weight sync, in memory, verified by a log-prob probe after every sync.

Every trainer rank runs :func:`converters.stream.export_hf` (its collectives need all ranks) and gets the whole
model, regrouped into byte buckets. A route takes the buckets to the engines: colocated engines map each bucket
where their trainer ranks packed it (:class:`ColocatedRoute`); engines on other devices receive it by broadcast
from trainer rank 0 (:class:`BroadcastRoute`). Afterwards the engines score a fixed probe batch, each its share of
the rows (:func:`engine_probe_rows`), and their log-probs are compared with the trainer's, scored before the push (so
the trainer's weights may leave the device before the engine's KV cache returns): stale or corrupted weights fail
loudly here instead of silently skewing the policy gradient.

Ray is imported only where an engine is called (:func:`_get`): a trainer without engines, as the GPU self-check
builds one, runs where Ray is not installed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from converters.stream import export_hf
from mcore_rl.rollout.transport import BucketSender
from mcore_rl.trainer.training import MegatronModel
from models.lora import LoRAConfig, export_peft, merged
from parallel.comm import all_gather_objects, all_reduce_scalar, byte_buckets, in_row_shares
from parallel.device import Device
from parallel.groups import block_group
from parallel.transfer import TransferGroup, free_addresses

log = logging.getLogger(__name__)

# Defaults of the probe's tolerances by engine dtype: (max |Δ|, mean |Δ|) of per-token log-probs.
PROBE_TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (1.0, 5e-2), torch.float16: (1.0, 5e-2)}
NOTHING_SENT = (0, 0, 0.0, ())  # a push's bytes, buckets, seconds waited for the engines, repairs: none


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
    # A LoRA policy's weights: "merged" (W + scale B A, any engine loads them as plain weights) or "adapter" (the
    # adapters alone, which the engines serve with vLLM's LoRA over the base weights they started with)
    lora: str = "merged"

    def validate(self, prefix: str = "sync") -> None:
        """Errors name each field under ``prefix`` (the run config's ``models.policy.sync``)."""
        if self.lora not in ("merged", "adapter"):
            raise ValueError(f"{prefix}.lora={self.lora!r}: expected 'merged' or 'adapter'")
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
    seconds: float  # the weights' transfer: export, pack and the engine's loads
    engine_wait_seconds: float  # of ``seconds``, time the owner rank waited for the engine to take buckets in
    probe_seconds: float  # the trainer's forward of the probe batch, before the transfer
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


def engine_probe_rows(rows: int, engines: int, index: int) -> list[int]:
    """The rows of the probe batch that engine ``index`` of ``engines`` scores: every ``engines``-th row from its
    index, or one row where there are more engines than rows. An engine is checked for its weights, which a share
    of the rows shows as well as all of them (every layer's weights and the LM head take part in every position, and
    a stale or mis-converted one moves the log-probs everywhere; only the embedding rows of the tokens it holds do),
    at a share of the cost: each engine scores on its own device's cores, and colocated engines do so at once."""
    return list(range(index, rows, engines)) or [index % rows]


def send_buckets(named: Iterator[tuple[str, torch.Tensor]], budget: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The exported HF tensors grouped into what the engine loads at once: at most ``budget`` bytes (or one)."""
    return byte_buckets(named, lambda item: item[1].numel() * item[1].element_size(), budget)


def _get(refs):
    """``ray.get``: the results of engine calls."""
    import ray

    return ray.get(refs)


def _waited(refs) -> float:
    start = time.perf_counter()
    _get(refs)
    return time.perf_counter() - start


class ColocatedRoute:
    """Buckets to the engine on this rank's devices, zero-copy (shared memory or CUDA IPC handles).

    Engines sit on blocks of ``engine_tp`` consecutive ranks (one engine worker per device); ``engine`` is the
    engine of this rank's block, or None where the block has none. Every rank of a block packs each bucket on
    its own device, and the block's first rank (the owner) sends the engine one handle naming every copy. Two
    buffers alternate, so packing bucket k+1 overlaps the engine loading bucket k. Collective: all ranks
    construct it.
    """

    def __init__(self, engine, device: torch.device, bucket_bytes: int, engine_tp: int = 1):
        self.feeders = block_group(engine_tp)  # the ranks feeding one engine (gloo: they exchange handles)
        self.owner = engine is not None and (self.feeders is None or torch.distributed.get_rank(self.feeders) == 0)
        self.engines = [engine] if self.owner else []
        self.senders = [BucketSender(device, bucket_bytes) for _ in range(2 if engine is not None else 0)]
        self._pending: list = [None, None]  # the engine's load in flight from each buffer

    @property
    def sends(self) -> bool:
        return bool(self.senders)

    def begin(self, lora: dict | None = None) -> None:
        """Open the engine's update (``lora``: adapters only, see ``RolloutEngine.begin_weight_update``)."""
        for sender in self.senders:
            sender.begin()
        if self.owner:
            _get(self.engines[0].begin_weight_update.remote(lora))
        self._pending = [None, None]

    def send(self, index: int, bucket: list[tuple[str, torch.Tensor]]) -> tuple[int, float]:
        """Pack and hand over bucket ``index``; (its bytes, seconds waited for the engine)."""
        slot, wait = index % 2, 0.0
        if self.owner and self._pending[slot] is not None:
            wait += _waited(self._pending[slot])  # the engine is done with this buffer...
        if self.feeders is not None:
            torch.distributed.barrier(group=self.feeders)  # ...on every feeder's device
        handle = self.senders[slot].pack(bucket)
        if self.feeders is not None:  # every copy of the bucket is packed once this returns
            copies = all_gather_objects(handle.buffers, self.feeders)
            handle = dataclasses.replace(handle, buffers=tuple(ref for refs in copies for ref in refs))
        if self.owner:  # queued behind the load of the previous bucket, which may still run
            self._pending[slot] = self.engines[0].load_bucket.remote(handle)
        return handle.nbytes, wait

    def finish(self, version: int) -> tuple[float, tuple[str, ...]]:
        """(seconds waited for the engine, the repairs it applied)."""
        if not self.owner:
            return 0.0, ()
        wait = _waited([p for p in self._pending if p is not None])
        wait += _waited(finish := self.engines[0].finish_weight_update.remote(version))
        return wait, tuple(_get(finish))

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
        if self.feeders is not None:
            torch.distributed.destroy_process_group(self.feeders)
            self.feeders = None


class BroadcastRoute:
    """Buckets to engines on other devices or nodes: trainer rank 0 broadcasts each one over the weight-transfer
    group (:class:`parallel.transfer.TransferGroup`) to every worker of every engine (``engines``, given on rank
    0; ``engine_tp`` workers each), which load it as it arrives. Only rank 0 constructs the group."""

    def __init__(self, engines: list, device: torch.device, bucket_bytes: int, engine_tp: int = 1):
        self.owner = torch.distributed.get_rank() == 0
        self.engines = list(engines) if self.owner else []
        self.senders = [BucketSender(device, bucket_bytes, kind="broadcast")] if self.owner else []
        self.group: TransferGroup | None = None
        if self.owner:
            from mcore_rl.roles.cluster import single_node

            address, world = free_addresses(1, single_node())[0], 1 + engine_tp * len(self.engines)
            joined = [e.join_transfer.remote(address, 1 + i * engine_tp, world) for i, e in enumerate(self.engines)]
            self.group = TransferGroup(address, 0, world, device)
            _get(joined)
        self._pending: list = []

    @property
    def sends(self) -> bool:
        return self.owner

    def begin(self, lora: dict | None = None) -> None:
        _get([e.begin_weight_update.remote(lora) for e in self.engines])
        self._pending = []

    def send(self, index: int, bucket: list[tuple[str, torch.Tensor]]) -> tuple[int, float]:
        handle = self.senders[0].pack(bucket)
        self._pending += [e.load_bucket.remote(handle) for e in self.engines]
        start = time.perf_counter()
        self.group.send(self.senders[0].packed(handle))  # returns once every worker has received it
        return handle.nbytes, time.perf_counter() - start

    def finish(self, version: int) -> tuple[float, tuple[str, ...]]:
        wait = _waited(self._pending)
        wait += _waited(finishes := [e.finish_weight_update.remote(version) for e in self.engines])
        return wait, tuple(r for repairs in _get(finishes) for r in repairs)

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
        if self.group is not None:
            self.group.close()
            self.group = None


class WeightSync:
    """Streams a trainer's weights into the rollout engines (Ray actors of ``RolloutEngine``) and checks them.

    ``route`` takes the buckets to the engines: :class:`ColocatedRoute` or :class:`BroadcastRoute`. ``scorer``
    is the trainer's model (or the train step wrapping it); its ``logprobs`` scores the probe batch on the
    trainer side, each data-parallel replica its share of the rows (a collective on all ranks). ``lora``: the
    policy's adapters, which ``config.lora: adapter`` sends alone (the engines serve them over their base
    weights). ``drafts``: the engines draft with the model's MTP layers (speculative decoding), which are then
    sent too. Collective: all ranks construct it.
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        bridge,
        groups,
        route: ColocatedRoute | BroadcastRoute,
        scorer: MegatronModel,
        config: SyncConfig,
        engine_dtype: torch.dtype,
        lora: LoRAConfig | None = None,
        drafts: bool = False,
    ):
        config.validate()
        if config.lora == "adapter" and not (lora and lora.rank):
            raise ValueError("sync.lora='adapter' needs the policy's LoRA adapters (models.policy_trainer.lora.rank)")
        self.adapter = {"rank": lora.rank, "alpha": lora.alpha} if config.lora == "adapter" else None
        self.chunks, self.bridge, self.groups, self.route, self.drafts = chunks, bridge, groups, route, drafts
        self.scorer = scorer
        self.config = config
        cuda = Device.current().cuda
        default_max, default_mean = bridge.engine_tolerance(cuda, engine_dtype) or PROBE_TOLERANCE[engine_dtype]
        self.max_tolerance = config.probe_max_tolerance if config.probe_max_tolerance is not None else default_max
        self.mean_tolerance = config.probe_mean_tolerance if config.probe_mean_tolerance is not None else default_mean
        device = next(chunks[0].parameters()).device
        self.probe_batch = probe_tokens(bridge.vocab_size, config).to(device)
        # the rows this rank's engines score: their places among all ranks' engines, in rank order
        counts = all_gather_objects(len(route.engines), torch.distributed.group.WORLD)
        rank, rows = torch.distributed.get_rank(), config.probe_sequences
        self.engine_rows = [
            engine_probe_rows(rows, sum(counts), sum(counts[:rank]) + i) for i in range(len(route.engines))
        ]
        self.count = 0  # pushes so far
        self._pushed: SyncReport | None = None  # the last push, until ``verify`` completes it
        self._trainer_logprobs: torch.Tensor | None = None  # of the probe batch, at the last push

    def sync(self, version: int | None = None) -> SyncReport:
        """``push``, then ``verify``: for callers whose trainer weights stay on the device."""
        self.push(version)
        return self.verify()

    def push(self, version: int | None = None, send: bool = True) -> SyncReport:
        """Load the current weights into the engines, whose KV caches stay asleep; tokens they sample from now on
        carry policy ``version`` (default: the number of pushes before this one). Collective over all ranks.
        ``send=False``: the engines hold these very weights already (they loaded them as ``version``), so none
        travel and ``verify`` checks them as it checks sent ones.

        The trainer scores the probe batch first, while its weights are on the device, so that they can leave
        before ``verify`` wakes the engines' KV caches: the two never meet on the device.
        """
        start = time.perf_counter()
        self._trainer_logprobs = self._score() if self.config.probe else None
        probed, start = time.perf_counter() - start, time.perf_counter()
        nbytes, buckets, wait, repairs = (
            self._send(self.count if version is None else version) if send else NOTHING_SENT
        )
        seconds = time.perf_counter() - start
        self._pushed = SyncReport(self.count, seconds, wait, probed, nbytes, buckets, None, None, repairs)
        self.count += 1
        return self._pushed

    def _send(self, version: int) -> tuple[int, int, float, tuple[str, ...]]:
        """The weights to the engines as ``version``: (bytes, buckets, seconds waited for the engines, the repairs
        they applied)."""
        if self.adapter is not None:  # the adapters alone, as PEFT tensors
            exported = export_peft(self.chunks, self.bridge, self.groups, self.config.bucket_bytes)
        else:  # LoRA-adapted weights leave merged with their adapters (any engine loads them as plain weights);
            # the MTP layers only to engines that draft with them
            exported = export_hf(
                self.chunks,
                self.bridge,
                self.groups,
                self.config.bucket_bytes,
                read=merged(self.chunks),
                mtp=self.drafts,
                stack_experts=False,
            )
        if not self.route.sends:  # this rank's part of the collective export
            for _ in exported:
                pass
            return NOTHING_SENT
        nbytes = buckets = 0
        wait = 0.0
        self.route.begin(self.adapter)
        for i, bucket in enumerate(send_buckets(exported, self.config.bucket_bytes)):
            size, waited = self.route.send(i, bucket)
            nbytes, buckets, wait = nbytes + size, buckets + 1, wait + waited
        waited, repairs = self.route.finish(version)
        return nbytes, buckets, wait + waited, repairs

    def verify(self) -> SyncReport:
        """Wake the engines' KV caches and (by default) compare their log-probs of the probe batch with the
        trainer's from ``push``; the last push's report, completed with the differences. Collective over all ranks.
        """
        pushed, self._pushed = self._pushed, None
        if pushed is None:
            raise RuntimeError("WeightSync.verify: nothing pushed since the last verify (call push first)")
        if self.route.engines:  # (ray.get of nothing would start Ray in a process that has none)
            _get([e.wake_up.remote() for e in self.route.engines])
        report = pushed
        if self._trainer_logprobs is not None:
            max_diff, mean_diff = self._compare(self._trainer_logprobs, f"after weight sync {pushed.index}")
            report = dataclasses.replace(pushed, probe_max_abs_diff=max_diff, probe_mean_abs_diff=mean_diff)
        if self.route.owner:
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
        """The trainer's log-probs of the probe batch on every rank, each data-parallel replica scoring its share of
        the rows (at least a row per micro-batch its pipeline schedule needs); a collective on all ranks."""

        def score(share: dict) -> torch.Tensor:
            return self.scorer.logprobs(share["tokens"], self.bridge.vocab_size, micro_batch_size=len(share["tokens"]))

        rows = {"tokens": self.probe_batch}
        return in_row_shares(score, rows, self.groups.dp, self.scorer.micro_batch_multiple).cpu()

    def _compare(self, trainer: torch.Tensor, when: str) -> tuple[float, float]:
        max_diff = mean_diff = 0.0
        engines, probe = self.route.engines, self.probe_batch.tolist()
        scores = [e.score.remote([probe[i] for i in rows]) for e, rows in zip(engines, self.engine_rows, strict=True)]
        for engine, rows in zip(_get(scores) if engines else (), self.engine_rows, strict=True):
            diff = (torch.tensor(engine, dtype=torch.float32) - trainer[rows]).abs()
            max_diff, mean_diff = max(max_diff, diff.max().item()), max(mean_diff, diff.mean().item())
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
        self.route.close()
