"""The Megatron roles, one Ray actor per rank: the reference policy or teacher (scoring only), the policy trainer
and PPO's critic.

Each role's ranks form their own torch.distributed world (gloo on CPU, NCCL on GPU) with their own Megatron
layout, so colocated roles never share a process group. Batches arrive whole on every rank as a dict of tensors
(see :mod:`mcore_rl.batch`); each data-parallel rank takes its share.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import torch

from converters.hf_io import StreamedShards, copy_model_files
from converters.stream import export_hf, load_weights
from converters.torch_dist import LORA_FILE, find_megatron, model_state
from mcore_rl.algorithms.grpo import PolicyLossConfig, Share, policy_loss
from mcore_rl.algorithms.mtp import mtp_logprobs, mtp_loss
from mcore_rl.algorithms.ppo import value_loss
from mcore_rl.console import setup_actor
from mcore_rl.logprobs import token_entropy, token_logprobs
from mcore_rl.metrics import process_stats
from mcore_rl.moe import MoEConfig, RouterLoad
from mcore_rl.offload import StorageOffloader
from mcore_rl.packing import pack_rows, plan_packing, plan_shared_prompts, rows_of, share_prompt_rows
from mcore_rl.sync import BroadcastRoute, ColocatedRoute, SyncConfig, WeightSync
from mcore_rl.training import MegatronModel, MegatronTrainStep, microbatches, recompute_overrides
from models.lora import LoRAConfig, adapters_off, attach_lora, keep_routers, merged
from models.mtp import MTPOutput, freeze_mtp, mtp_active
from models.registry import get_bridge
from models.value_head import attach_value_heads
from parallel.comm import all_gather_bucket, all_reduce_, all_reduce_scalar
from parallel.config import ParallelConfig
from parallel.device import Device
from parallel.groups import init_parallel

log = logging.getLogger(__name__)

HF_DIR = "hf"  # a checkpoint's HF model (runtime_args.save_hf)
HF_SHARD_BYTES = 5 * 10**9  # HF's default max_shard_size


class MegatronRank:
    """One rank of a Megatron model loaded from an HF directory, scoring sequences (the reference policy)."""

    def __init__(
        self,
        rank: int,
        world: int,
        master: tuple[str, int],
        hf_dir: str,
        parallel: ParallelConfig,
        seed: int,
        max_token_in_packing: int = 0,
        share_prompts: bool = False,
        overrides: dict | None = None,
        cores: list[int] | None = None,
    ):
        """``share_prompts``: score (and train) each prompt's samples in one row that holds the prompt once
        (:func:`mcore_rl.packing.share_prompt_rows`); needs whole groups per data-parallel rank and step.
        ``cores``: the CPU cores of this rank's device, where roles on other devices run at the same time."""
        setup_actor()  # its output to its log file, its stacks for the hang watchdog
        os.environ.update(
            MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0"
        )
        self.machine = Device.current()
        self.machine.share_cores(world, cores)
        self.rank, self.parallel, self.seed = rank, parallel, seed
        self.max_token_in_packing = max_token_in_packing  # > 0: THD packs instead of padded micro-batches
        self.groups = init_parallel(parallel, seed=seed, device=self.machine)
        self.hf_dir, self.bridge = hf_dir, get_bridge(hf_dir)
        self.config = self.bridge.transformer_config(parallel, **(self._model_overrides() | (overrides or {})))
        self.share_prompts = share_prompts
        self.chunks = self._build(hf_dir)
        self.device = next(self.chunks[0].parameters()).device
        self.model = MegatronModel(self.chunks, self.groups)
        self.offloaders: dict[str, StorageOffloader] = {}

    def _model_overrides(self) -> dict:
        """TransformerConfig fields the role sets beyond the layout's."""
        return {}

    def _local_layers(self) -> bool:
        """Whether the model needs Megatron's local layers rather than TransformerEngine's (which ``auto`` picks on
        CUDA): shared-prompt rows carry a block attention mask that TransformerEngine's fused attention does not
        take."""
        return self.share_prompts

    def _build(self, hf_dir: str) -> list[torch.nn.Module]:
        """This rank's model chunks, adapted (:meth:`_adapt`) and loaded from ``hf_dir``."""
        chunks = self.bridge.build_model(self.config, **({"backend": "local"} if self._local_layers() else {}))
        self._adapt(chunks, hf_dir)
        load_weights(chunks, self.bridge, hf_dir, self.groups)
        return chunks

    def _adapt(self, chunks: list[torch.nn.Module], hf_dir: str) -> None:
        """What a role changes on its model before the weights load from ``hf_dir`` (which may hold it)."""

    def _routing(self, batch: dict) -> tuple[str, ...]:
        """The rollout's routing, as a batch key to pass to the model, where this model replays it."""
        if not self.config.moe_enable_routing_replay:
            return ()
        if "routed_experts" not in batch:
            raise ValueError("routing replay is on, but the batch has no routed_experts from the rollout engine")
        return ("routed_experts",)

    @property
    def dp(self) -> tuple[int, int]:
        """Data-parallel size and rank: how the rows of a batch are shared (CP ranks of one DP rank share rows)."""
        group = self.groups.dp
        return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)

    def logprobs(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """Log-probs [N, L-1] of ``batch["tokens"]``; each DP rank scores its share, every rank gets all rows."""
        vocab = self.bridge.vocab_size
        return self._score(batch, micro_batch_size, lambda mb, output: token_logprobs(output, mb["labels"], vocab))

    def _score(self, batch: dict, micro_batch_size: int, measure) -> torch.Tensor:
        """``measure`` (see :meth:`MegatronModel.score`) of every row of ``batch``, each DP rank scoring its share."""
        size, rank = self.dp
        packing = self.max_token_in_packing
        if self.share_prompts:  # whole prompt groups, token-balanced: the ranks' shares differ in rows
            tokens = batch["tokens"].to(self.device)
            lengths, prompts = batch["lengths"].tolist(), batch["prompt_lengths"].tolist()
            plan = self._shared_plan(tokens, lengths, prompts, micro_batch_size)[rank]
            local = self.model.score(
                tokens, measure, micro_batch_size, lengths, prompt_lengths=prompts, shared_plan=plan
            )
            return all_reduce_(local, self.groups.dp).cpu()  # each row is scored on one rank, 0 on the others
        mine = {k: batch[k].chunk(size)[rank].to(self.device) for k in ("tokens", *self._routing(batch))}
        lengths = batch["lengths"].chunk(size)[rank].tolist() if packing else None
        tokens = mine.pop("tokens")
        local = self.model.score(tokens, measure, micro_batch_size, lengths, packing, **mine)
        return torch.cat([shards[0] for shards in all_gather_bucket([local], self.groups.dp)]).cpu()

    def _shared_plan(self, tokens, lengths: list[int], prompts: list[int], micro_batch_size: int):
        """Micro-batches of whole prompt groups for every data-parallel rank, as many on each (expert-parallel
        ranks exchange tokens in every one): ``max_token_in_packing`` positions each, or ``micro_batch_size``
        padded rows' worth."""
        budget = self.max_token_in_packing or micro_batch_size * max(lengths)
        return plan_shared_prompts(tokens, lengths, prompts, budget, self.dp[0], self.model.micro_batch_multiple)

    def process_stats(self) -> dict[str, float]:
        return process_stats()

    def memory_bytes(self) -> int:
        """Device memory in use by this process (CUDA), or its resident set size (CPU)."""
        return self.machine.memory_in_use()

    offload_parts: tuple[str, ...] = ("weights",)

    def _offloadable(self, part: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors whose contents ``part`` keeps, tensors it discards) for :class:`StorageOffloader`."""
        return [p.data for chunk in self.chunks for p in chunk.parameters()], []

    def offload(self, parts: list[str] | None = None) -> int:
        """Free the device memory of ``parts`` (default: all) while other roles run; returns the bytes freed (CUDA;
        on CPU there is nothing to move to)."""
        if not self.machine.offloads:
            return 0
        freed = 0
        for part in parts or self.offload_parts:
            if part not in self.offloaders:
                self.offloaders[part] = StorageOffloader(*self._offloadable(part), pin=self.machine.pin_host_copies)
            freed += self.offloaders[part].offload()
        self.machine.release_cached_memory()
        return freed

    def onload(self, parts: list[str] | None = None) -> int:
        return sum(self.offloaders[p].onload() for p in parts or self.offload_parts if p in self.offloaders)


class TrainableRank(MegatronRank):
    """One rank of a trained Megatron role (the policy, the critic): its optimizer and LR schedule, optimizer steps
    over global batches, offload of weights and optimizer state apart, and checkpoints under ``checkpoint_dir``."""

    checkpoint_dir = ""  # the role's subdirectory of a run's checkpoint

    def __init__(
        self,
        rank: int,
        world: int,
        master: tuple[str, int],
        hf_dir: str,
        parallel: ParallelConfig,
        seed: int,
        optimizer: dict,
        total_steps: int,
        max_token_in_packing: int = 0,
        share_prompts: bool = False,
        recompute: str = "none",
        overrides: dict | None = None,
        cores: list[int] | None = None,
    ):
        """``recompute``: ``"full"`` recomputes each layer's activations in the backward (``recompute_overrides``);
        ``overrides``: TransformerConfig fields beyond what the run config sets (a test's ``params_dtype``)."""
        self.recompute = recompute
        super().__init__(
            rank, world, master, hf_dir, parallel, seed, max_token_in_packing, share_prompts, overrides, cores
        )
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        settings = dict(optimizer)
        warmup, min_lr, decay = settings.pop("lr_warmup_steps"), settings.pop("min_lr"), settings.pop("lr_decay_style")
        config = OptimizerConfig(
            optimizer="adam", bf16=self.config.bf16, use_distributed_optimizer=True, min_lr=min_lr, **settings
        )
        self.model = MegatronTrainStep(self.chunks, self.config, config, self.groups, self.machine)
        self.scheduler = OptimizerParamScheduler(
            self.model.optimizer,
            init_lr=0.0 if warmup else config.lr,
            max_lr=config.lr,
            min_lr=min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=max(total_steps, warmup + 1),
            lr_decay_style=decay,
            start_wd=config.weight_decay,
            end_wd=config.weight_decay,
            wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant",
        )

    def _model_overrides(self) -> dict:
        return recompute_overrides(self.recompute)

    def _optimize(self, steps: list[dict], names: list[str], micro_batch_size: int, loss_fn) -> list[dict]:
        """One optimizer step per global batch in ``steps`` (whole on every rank; each DP rank takes its share),
        with ``names``: the batch keys the loss reads, split into micro-batches with the rows; metrics per step."""
        size, rank = self.dp
        results = []
        for step in steps:
            keys = [k for k in names if k in step]
            if self.share_prompts:
                mbs, packing = self._shared(step, keys, size, rank, micro_batch_size)
            elif self.max_token_in_packing:
                mbs, packing = self._packed(step, keys, size, rank)
            else:
                rows = {k: v.chunk(size)[rank].to(self.device) for k, v in step.items()}
                mbs = microbatches(rows["tokens"], micro_batch_size, self.model.align, **{k: rows[k] for k in keys})
                packing = {}
            share = Share.of(step["mask"], len(mbs), size)  # batch means, whatever the micro-batches
            result = self.model.step([mb | {"share": share} for mb in mbs], loss_fn)
            self.scheduler.step(increment=1)
            results.append(
                result.metrics
                | packing
                | {
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "update_successful": float(result.update_successful),
                    "lr": self.model.optimizer.param_groups[0]["lr"],
                }
            )
        return results

    def _shared(self, step: dict, names: list[str], size: int, rank: int, micro_batch_size: int):
        """This rank's shared-prompt micro-batches of a global batch: whole prompt groups, token-balanced over
        data-parallel ranks and micro-batches; and their positions per sample position."""
        lengths, prompts = step["lengths"].tolist(), step["prompt_lengths"].tolist()
        plan = self._shared_plan(step["tokens"], lengths, prompts, micro_batch_size)
        rows = {k: step[k].to(self.device) for k in ("tokens", *names)}
        extra = {k: rows[k] for k in names}
        mbs = [share_prompt_rows(rows["tokens"], lengths, prompts, mb, self.model.align, **extra) for mb in plan[rank]]
        positions = sum(mb["input_ids"].shape[1] for mb in mbs) / sum(
            lengths[i] - 1 for mb in plan[rank] for group in mb for i in group
        )
        return mbs, {"packing/shared_prompt_positions": positions, "packing/micro_batches": float(len(mbs))}

    def _packed(self, step: dict, names: list[str], size: int, rank: int) -> tuple[list[dict], dict]:
        """This rank's THD micro-batches of a global batch, token-balanced over DP ranks and micro-batches."""
        lengths, align = step["lengths"].tolist(), self.model.align
        multiple = self.model.micro_batch_multiple
        plan = plan_packing([n - 1 for n in lengths], self.max_token_in_packing, size, align=align, multiple=multiple)
        rows = {k: step[k].to(self.device) for k in ("tokens", *names)}
        extra = {k: rows[k] for k in names}
        mbs = [pack_rows(rows["tokens"], lengths, mb, align, **extra) for mb in plan.ranks[rank]]
        return mbs, {"packing/utilization": plan.utilization, "packing/micro_batches": float(len(mbs))}

    # The sync needs the weights but not the optimizer: offloaded apart, the engine's weights never meet the
    # optimizer state on the device.
    offload_parts = ("weights", "optimizer")

    def _offloadable(self, part: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        weights = super()._offloadable("weights")[0]
        if part == "weights":
            return weights, []
        keep, owned = [], {w.untyped_storage().data_ptr() for w in weights}
        for opt in self._optimizers():
            for group in opt.optimizer.param_groups:
                keep.extend(group["params"])  # main (fp32) parameters: views of the weights when those are fp32
            keep.extend(t for state in opt.optimizer.state.values() for t in state.values() if torch.is_tensor(t))
        grads = [
            buffer.grad_data for chunk in self.model.model for buffer in chunk.buffers + chunk.expert_parallel_buffers
        ]
        return [t for t in keep if t.untyped_storage().data_ptr() not in owned], grads

    def _optimizers(self) -> list:
        return list(getattr(self.model.optimizer, "chained_optimizers", [self.model.optimizer]))

    # ---- checkpoints --------------------------------------------------------------------------------------
    def _sharded_state(self, is_loading: bool) -> dict:
        model = model_state(self.chunks)
        # Resharding-friendly optimizer layout: a checkpoint saved under one layout loads under another.
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        optimizer = self.model.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=metadata)
        return {**model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def save(self, directory: str) -> None:
        """Model, optimizer and LR schedule as a Megatron distributed checkpoint in ``directory/checkpoint_dir``."""
        from megatron.core import dist_checkpointing

        (Path(directory) / self.checkpoint_dir).mkdir(exist_ok=True)
        dist_checkpointing.save(self._sharded_state(is_loading=False), str(Path(directory) / self.checkpoint_dir))

    def load(self, directory: str) -> None:
        from megatron.core import dist_checkpointing
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for opt in self._optimizers():
            if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()  # Adam's state exists only after a step otherwise
        path = str(Path(directory) / self.checkpoint_dir)
        state = dist_checkpointing.load(self._sharded_state(is_loading=True), path)
        for i, chunk in enumerate(self.chunks):
            chunk.load_state_dict(state[f"model{i}"])
        self.model.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def optimizer_digest(self) -> dict:
        """Step count and sums of Adam's moments over all ranks: equal before a save and after its load."""
        step, sums = 0.0, {"exp_avg": 0.0, "exp_avg_sq": 0.0}
        for opt in self._optimizers():
            for state in opt.optimizer.state.values():
                step = max(step, float(state.get("step", 0)))
                for key in sums:
                    if key in state:
                        sums[key] += state[key].double().sum().item()
        world = torch.distributed.group.WORLD
        return {"step": all_reduce_scalar(step, world, "max")} | {
            k: all_reduce_scalar(v, world) for k, v in sums.items()
        }


class PolicyTrainer(TrainableRank):
    """One rank of the policy: GRPO/GSPO steps, the weight sync into its rollout engine, checkpoints."""

    def __init__(
        self,
        *args,
        loss: PolicyLossConfig,
        moe: MoEConfig | None = None,
        lora: LoRAConfig | None = None,
        mtp_loss_coef: float = 0.0,
        save_hf: bool = False,
        **kwargs,
    ):
        """:class:`TrainableRank`'s arguments, the policy's ``loss``, its ``moe`` settings, its ``lora`` adapters
        (rank 0: none, the whole model trains), the weight of its MTP layers' loss (0: they stay frozen) and whether
        its checkpoints hold the HF model too (``save_hf``)."""
        self.moe, self.lora, self.mtp_loss_coef = moe or MoEConfig(), lora or LoRAConfig(), mtp_loss_coef
        self.save_hf = save_hf
        super().__init__(*args, **kwargs)
        self.loss = loss
        self.router_load = (
            RouterLoad(self.chunks, self.groups, self.parallel.sequence_parallel)
            if self.moe.router_metrics and self.bridge.num_experts
            else None
        )
        self.sync: WeightSync | None = None

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

    # ---- training -----------------------------------------------------------------------------------------
    def _loss_fn(self, batch: dict, output: torch.Tensor | MTPOutput):
        vocab = self.bridge.vocab_size
        output, depths = output if isinstance(output, MTPOutput) else (output, ())
        logp = rows_of(batch, token_logprobs(output, batch["labels"], vocab))
        # The first step's old policy is the current one: its old log-probs are its own, detached (ratio 1).
        old_logp = batch["old_logp"] if "old_logp" in batch else logp.detach()
        # Logged, and optimised only with a coefficient: without one, no graph keeps its [tokens, V/tp] tensors.
        with torch.set_grad_enabled(bool(self.loss.entropy_coef) and torch.is_grad_enabled()):
            entropy = rows_of(batch, token_entropy(output, vocab, self.groups.tp))
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
            logps = [rows_of(batch, x) for x in mtp_logprobs(batch, depths, vocab, self.groups.cp)]
            mtp = mtp_loss(logps, batch["mask"], batch["share"])
            loss = loss + self.mtp_loss_coef * mtp
            metrics = metrics | {"mtp/loss": mtp.detach()}
        return loss, metrics | {"loss": loss.detach()}

    def train(self, batch: dict, global_batch_size: int, micro_batch_size: int) -> list[dict]:
        """Optimizer steps over ``batch`` in global batches of ``global_batch_size`` rows; metrics per step.

        ``batch["old_logp"]`` covers its last rows (all, or those after the first step): a step without them is
        the first, whose old policy is the current one (:meth:`_loss_fn`).
        """
        batch = dict(batch)
        old = batch.pop("old_logp", None)
        first_old = batch["tokens"].shape[0] - (old.shape[0] if old is not None else 0)
        steps = []
        for start in range(0, batch["tokens"].shape[0], global_batch_size):
            step = {k: v[start : start + global_batch_size] for k, v in batch.items()}
            if start >= first_old:
                step["old_logp"] = old[start - first_old : start - first_old + global_batch_size]
            elif start + global_batch_size > first_old:
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
        with the model's MTP layers, which the sync then sends."""
        device = next(self.chunks[0].parameters()).device
        if colocated:
            route = ColocatedRoute(engines[self.rank // engine_tp], device, sync.bucket_bytes, engine_tp)
        else:
            route = BroadcastRoute(engines, device, sync.bucket_bytes, engine_tp)
        engine_dtype = getattr(torch, dtype)
        self.sync = WeightSync(
            self.chunks, self.bridge, self.groups, route, self.model, sync, engine_dtype, self.lora, drafts
        )

    def push_weights(self, version: int) -> None:
        """Load the weights into the engines as policy ``version`` (a colocated engine's KV cache stays asleep);
        ``verify_sync`` completes it."""
        self.sync.push(version)

    def verify_sync(self) -> dict:
        """Wake the engines and check them with the probe; works with this rank's weights offloaded."""
        report = self.sync.verify()
        return {
            "sync_seconds": report.seconds,
            "sync_engine_wait_seconds": report.engine_wait_seconds,
            "sync_gb_per_s": report.gb_per_s if report.bytes else 0.0,
            "sync_bytes": float(report.bytes),
            "probe_max_abs_diff": report.probe_max_abs_diff,
            "probe_mean_abs_diff": report.probe_mean_abs_diff,
        }

    # ---- checkpoints --------------------------------------------------------------------------------------
    checkpoint_dir = "policy"

    def save(self, directory: str) -> None:
        """The role's checkpoint (:meth:`TrainableRank.save`), its LoRA settings and this rank's RNG states; with
        ``save_hf``, the HF model in ``directory/hf`` (:meth:`_save_hf`)."""
        from megatron.core import tensor_parallel

        super().save(directory)
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


class ValueModel(MegatronRank):
    """One rank of a model with a :class:`models.value_head.ValueHead` for its LM head, loaded from ``hf_dir``: a
    reward model of a supported family (its score head is the value head), or a causal LM (the policy's own, for a
    critic that starts from it: its LM head is dropped and the value head starts fresh). Scores values per position
    (PPO's critic) or one per sequence (a reward model)."""

    def _build(self, hf_dir: str) -> list[torch.nn.Module]:
        chunks = super()._build(hf_dir)
        if not self.bridge.value_model:
            attach_value_heads(chunks, self.groups.tp)
        return chunks

    def values(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """The value [N, L-1] of every input position of ``batch["tokens"]`` (the state before the token at the
        next position, aligned with log-probs); every rank gets all rows."""
        return self._score(batch, micro_batch_size, lambda mb, output: output.squeeze(-1))

    def sequence_scores(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """The value [N] at each sequence's last token (``batch["lengths"]`` tokens each), as HF's sequence
        classifiers pool it: a reward model's score of the whole conversation. Any number of rows: the data-parallel
        ranks share them after copies of the last fill the batch to a multiple of their number."""
        n, extra = len(batch["lengths"]), -len(batch["lengths"]) % self.dp[0]
        lengths = torch.cat([batch["lengths"], batch["lengths"][-1:].expand(extra)])
        tokens = torch.cat([batch["tokens"], batch["tokens"][-1:].expand(extra, -1)])
        tokens = torch.nn.functional.pad(tokens, (0, 1))  # every real token becomes an input position
        values = self.values({"tokens": tokens, "lengths": lengths + 1}, micro_batch_size)
        return values[torch.arange(n), lengths[:n] - 1]


class ValueTrainer(TrainableRank, ValueModel):
    """One rank of PPO's critic: a :class:`ValueModel` trained with the clipped value loss."""

    checkpoint_dir = "critic"

    def __init__(self, *args, value_clip: float = 0.5, **kwargs):
        """:class:`TrainableRank`'s arguments and PPO's ``value_clip``."""
        super().__init__(*args, **kwargs)
        self.value_clip = value_clip

    def _loss_fn(self, batch: dict, output: torch.Tensor):
        values = rows_of(batch, output.squeeze(-1).float())
        loss, metrics = value_loss(
            values, batch["values"], batch["returns"], batch["mask"], self.value_clip, batch["share"]
        )
        return loss, metrics | {"loss": loss.detach()}

    def train(self, batch: dict, global_batch_size: int, micro_batch_size: int) -> list[dict]:
        """Optimizer steps towards ``batch["returns"]`` from ``batch["values"]`` (the values the returns were
        estimated with: the clip's centre), in global batches of ``global_batch_size`` rows; metrics per step."""
        steps = [
            {k: v[start : start + global_batch_size] for k, v in batch.items()}
            for start in range(0, batch["tokens"].shape[0], global_batch_size)
        ]
        return self._optimize(steps, ["mask", "values", "returns"], micro_batch_size, self._loss_fn)
