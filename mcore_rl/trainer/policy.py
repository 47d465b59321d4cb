"""The policy trainer's rank: GRPO-family losses, LoRA, MTP, the weight sync to the engines, HF weights at save."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from converters.hf_io import StreamedShards, copy_model_files
from converters.stream import export_hf
from converters.torch_dist import LORA_FILE, find_megatron
from mcore_rl.algorithms.grpo import PolicyLossConfig, policy_loss
from mcore_rl.algorithms.mtp import mtp_logprobs, mtp_loss
from mcore_rl.batch import step_starts
from mcore_rl.trainer.logprobs import token_scores
from mcore_rl.trainer.moe import RouterLoad
from mcore_rl.trainer.packing import rows_of
from mcore_rl.trainer.ranks import TrainableRank
from mcore_rl.trainer.sync import BroadcastRoute, ColocatedRoute, SyncConfig, WeightSync
from models.lora import adapters_off, attach_lora, keep_routers, merged
from models.mtp import MTPOutput, freeze_mtp, mtp_active

if TYPE_CHECKING:
    from mcore_rl.config.schema import TrainerConfig

log = logging.getLogger(__name__)

HF_DIR = "hf"  # a checkpoint's HF model (runtime_args.save_hf)
HF_SHARD_BYTES = 5 * 10**9  # HF's default max_shard_size


class PolicyTrainer(TrainableRank):
    """One rank of the policy: GRPO/GSPO steps, the weight sync into its rollout engine, checkpoints."""

    def __init__(
        self,
        rank: int,
        world: int,
        master: tuple[str, int],
        section: TrainerConfig,
        seed: int,
        total_steps: int,
        save_hf: bool = False,
        overrides: dict | None = None,
        cores: list[int] | None = None,
    ):
        """:class:`TrainableRank`'s arguments (the section's ``algorithm`` is the loss; its ``moe`` settings, its
        ``lora`` adapters: rank 0, none, the whole model trains; its ``mtp_loss_coef``, the weight of its MTP layers'
        loss: 0, they stay frozen) and whether its checkpoints hold the HF model too (``save_hf``)."""
        self.moe, self.lora, self.mtp_loss_coef = section.moe, section.lora, section.mtp_loss_coef
        self.save_hf = save_hf
        super().__init__(rank, world, master, section, seed, total_steps, overrides, cores)
        self.loss: PolicyLossConfig = section.algorithm
        self.router_load = (
            RouterLoad(self.chunks, self.groups, self.parallel.sequence_parallel)
            if self.moe.router_metrics and self.bridge.num_experts
            else None
        )
        self.sync: WeightSync | None = None
        self._old_logp: torch.Tensor | None = None  # :meth:`score_old`'s, until :meth:`train` takes them

    def _model_overrides(self) -> dict:
        return super()._model_overrides() | self.moe.overrides(self.bridge)

    def _local_layers(self) -> bool:
        """LoRA adapts Megatron's own tensor-parallel linears too: TransformerEngine's fuse the layer norm into the
        linear, whose hook would then see the input before the norm."""
        return super()._local_layers() or bool(self.lora.rank)

    def _adapt(self, chunks: list[torch.nn.Module], hf_dir: str) -> None:
        """Frozen with LoRA adapters on it where the run trains adapters (the optimizer then holds theirs only:
        Megatron's DDP and optimizer take the parameters that require gradients). They start fresh, or as the
        Megatron checkpoint it loads holds them (``hf2mcore --peft``), which must be of this run's rank and alpha."""
        if self.lora.rank:
            if (settings := self._lora_settings(hf_dir)) is not None:
                self._check_lora(settings, "to continue from its adapters", continuing=True)
            attach_lora(chunks, self.lora, self.seed, self.groups.tp)
        elif not self.mtp_loss_coef:
            freeze_mtp(chunks)

    def _build(self, hf_dir: str) -> list[torch.nn.Module]:
        """Loaded, a LoRA run that trains the routers copies them for its reference, unless the checkpoint it
        continues from holds the copies (its routers trained already)."""
        chunks = super()._build(hf_dir)
        settings = self._lora_settings(hf_dir)
        if self.lora.train_router and not (settings and json.loads(settings.read_text()).get("train_router")):
            keep_routers(chunks)
        return chunks

    @staticmethod
    def _lora_settings(hf_dir: str) -> Path | None:
        """The LoRA settings of the Megatron checkpoint ``hf_dir`` holds, where it holds adapters."""
        megatron = find_megatron(hf_dir)
        return megatron / LORA_FILE if megatron is not None and (megatron / LORA_FILE).is_file() else None

    def base_logprobs(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """:meth:`logprobs` of the model without its LoRA adapters: the reference policy of a LoRA run."""
        with adapters_off(self.chunks):
            return self.logprobs(batch, micro_batch_size)

    def score_old(self, batch: dict, micro_batch_size: int, fetch: bool) -> torch.Tensor | None:
        """The policy's log-probs of ``batch`` (the last rows of the next :meth:`train`'s, or none) before its
        steps, kept here for them (every rank holds them after scoring): old log-probs never travel to the driver
        and back. Returned where the driver reads them (``fetch``: a KL penalty in the reward, distillation)."""
        self._old_logp = self.logprobs(batch, micro_batch_size) if len(batch["tokens"]) else None
        return self._old_logp if fetch else None

    # ---- training -----------------------------------------------------------------------------------------
    def _loss_fn(self, batch: dict, output: torch.Tensor | MTPOutput):
        vocab = self.bridge.vocab_size
        output, depths = output if isinstance(output, MTPOutput) else (output, ())
        logp, entropy = (rows_of(batch, x) for x in token_scores(output, batch["labels"], vocab, self.groups.tp))
        # The first step's old policy is the current one: its old log-probs are its own, detached (ratio 1).
        old_logp = batch["old_logp"] if "old_logp" in batch else logp.detach()
        entropy = entropy if self.loss.entropy_coef else entropy.detach()  # logged; optimised with a coefficient
        loss, metrics = policy_loss(
            self.loss,
            logp,
            old_logp,
            batch["advantages"],
            batch["mask"],
            ref_logp=batch.get("ref_logp"),
            rollout_logp=batch["rollout_logp"],
            entropy=entropy,
            share=batch["share"],
        )
        if depths:  # the MTP layers' loss on the same samples (models/mtp.py)
            logps = [rows_of(batch, x) for x in mtp_logprobs(batch, depths, vocab, self.groups.tp, self.groups.cp)]
            mtp = mtp_loss(logps, batch["mask"], batch["share"])
            loss = loss + self.mtp_loss_coef * mtp
            metrics = metrics | {"mtp/loss": mtp.detach()}
        return loss, metrics | {"loss": loss.detach()}

    def train(self, batch: dict, global_batch_size: int, micro_batch_size: int) -> list[dict]:
        """Optimizer steps over ``batch`` in global batches of ``global_batch_size`` samples (the rows they became:
        :func:`~mcore_rl.batch.step_starts`); metrics per step.

        The old log-probs (``batch["old_logp"]``, else those :meth:`score_old` kept) cover its last rows (all, or
        those after the first step): a step without them is the first, whose old policy is the current one
        (:meth:`_loss_fn`).
        """
        batch = dict(batch)
        old, self._old_logp = batch.pop("old_logp", self._old_logp), None
        first_old = batch["tokens"].shape[0] - (old.shape[0] if old is not None else 0)
        steps = []
        starts = step_starts(batch, global_batch_size)
        for start, end in zip(starts, [*starts[1:], batch["tokens"].shape[0]], strict=True):
            step = {k: v[start:end] for k, v in batch.items()}
            if start >= first_old:
                step["old_logp"] = old[start - first_old : end - first_old]
            elif end > first_old:
                raise ValueError(f"old_logp starts at row {first_old}, inside the step of rows {start}+")
            steps.append(step)
        names = ["mask", "old_logp", "rollout_logp", "ref_logp", *self._routing(batch), "advantages"]
        with mtp_active(self.chunks) if self.mtp_loss_coef else contextlib.nullcontext():
            return self._optimize(steps, names, micro_batch_size, self._loss_fn)

    def router_metrics(self) -> dict:
        """Router load over the training steps since the last call (:class:`RouterLoad`); {} for dense models."""
        return self.router_load.collect() if self.router_load is not None else {}

    # ---- weight sync --------------------------------------------------------------------------------------
    def connect_engines(
        self, engines: list, colocated: bool, engine_tp: int, sync: SyncConfig, dtype: str, drafts: bool = False
    ) -> None:
        """Attach the rollout engines: colocated, the engine on this rank's devices (one per block of ``engine_tp``
        ranks); on other devices, all of them, fed by rank 0 over a weight-transfer group. ``drafts``: they draft
        with the model's MTP layers, which the sync then sends. Again after an engine was replaced: the routes to
        the engines are built anew."""
        if self.sync is not None:
            self.sync.close()
        device = next(self.chunks[0].parameters()).device
        if colocated:
            route = ColocatedRoute(engines[self.rank // engine_tp], device, sync.bucket_bytes, engine_tp)
        else:
            route = BroadcastRoute(engines, device, sync.bucket_bytes, engine_tp)
        engine_dtype = getattr(torch, dtype)
        self.sync = WeightSync(
            self.chunks, self.bridge, self.groups, route, self.model, sync, engine_dtype, self.lora, drafts
        )

    def push_weights(self, version: int, send: bool = True) -> None:
        """Load the weights into the engines as policy ``version`` (a colocated engine's KV cache stays asleep);
        ``verify_sync`` completes it. ``send=False``: the engines hold them already (see ``WeightSync.push``)."""
        self.sync.push(version, send)

    def verify_sync(self) -> dict:
        """Wake the engines and check them with the probe; works with this rank's weights offloaded."""
        report = self.sync.verify()
        return {
            "sync_seconds": report.seconds,
            "sync_engine_wait_seconds": report.engine_wait_seconds,
            "sync_probe_seconds": report.probe_seconds,
            "sync_gb_per_s": report.gb_per_s if report.bytes else 0.0,
            "sync_bytes": float(report.bytes),
            "probe_max_abs_diff": report.probe_max_abs_diff,
            "probe_mean_abs_diff": report.probe_mean_abs_diff,
        }

    # ---- checkpoints --------------------------------------------------------------------------------------
    checkpoint_dir = "policy"

    def save(self, directory: str, reshardable: bool = False) -> None:
        """The role's checkpoint (:meth:`TrainableRank.save`), its LoRA settings and this rank's RNG states; with
        ``save_hf``, the HF model in ``directory/hf`` (:meth:`_save_hf`)."""
        from megatron.core import tensor_parallel

        super().save(directory, reshardable)
        if self.save_hf:
            self._save_hf(Path(directory) / HF_DIR)
        if self.lora.rank and self.rank == 0:  # what the converters need to export the adapters
            settings = json.dumps(self.lora.settings()) + "\n"
            (Path(directory) / self.checkpoint_dir / LORA_FILE).write_text(settings)
        rng = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
        if self.machine.cuda:
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, Path(directory) / f"rng_rank{self.rank}.pt")

    def _save_hf(self, out: Path) -> None:
        """The policy as an HF model directory (safetensors shards of at most 5 GB, and the model's config and
        tokenizer files) that `vllm serve` or transformers load: streamed through the sync's export (merged with
        the LoRA adapters, MTP layers kept), rank 0 writing what every rank gathers."""
        read = merged(self.chunks)  # each parameter itself, an adapted one merged
        writer = None
        if self.rank == 0:
            out.mkdir()
            writer = StreamedShards(out, HF_SHARD_BYTES)
        for name, tensor in export_hf(self.chunks, self.bridge, self.groups, read=read):
            if writer is not None:
                writer.write(name, tensor)
        if writer is not None:
            writer.close()
            copy_model_files(self.hf_dir, out)

    def load(self, directory: str) -> None:
        from megatron.core import tensor_parallel

        self._check_lora(
            Path(directory) / self.checkpoint_dir / LORA_FILE,
            "to resume, or give the run a new runtime_args.output_dir",
        )
        super().load(directory)
        rng = torch.load(Path(directory) / f"rng_rank{self.rank}.pt", weights_only=True)  # tensors only, no code
        torch.set_rng_state(rng["cpu"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])

    def _check_lora(self, settings: Path, purpose: str, continuing: bool = False) -> None:
        """The checkpoint's adapters (``settings``: their rank, alpha and whether the routers trained beside them,
        where it has any) are this run's. A run ``continuing`` from them may train routers they kept frozen."""

        def text(lora: dict | None) -> str:
            if not lora:
                return "no LoRA adapters"
            routers = ", trained routers" if lora.get("train_router") else ""
            return f"LoRA rank {lora['rank']}, alpha {lora['alpha']}{routers}"

        saved = json.loads(settings.read_text()) if settings.is_file() else None
        ours = self.lora.settings()
        if continuing and saved and ours and not saved.get("train_router"):
            ours.pop("train_router", None)
        if saved != ours:
            raise ValueError(
                f"{settings.parent}: holds {text(saved)}, but models.policy_trainer.lora gives {text(ours)}; set it "
                f"as the checkpoint's {purpose}"
            )
