"""The Megatron roles' ranks, one Ray actor each: the scoring rank (the reference policy, a teacher) and what every
trained rank shares (the policy trainer, :mod:`mcore_rl.trainer.policy`; PPO's critic, :mod:`mcore_rl.trainer.value`).

Each role's ranks form their own torch.distributed world (gloo on CPU, NCCL on GPU) with their own Megatron
layout, so colocated roles never share a process group. Batches arrive whole on every rank as a dict of tensors
(see :mod:`mcore_rl.batch`); each data-parallel rank takes its share.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from converters.stream import load_weights
from converters.torch_dist import model_state
from mcore_rl.algorithms.grpo import Share
from mcore_rl.checkpoint import (
    OPTIMIZER_LAYOUT,
    PARALLEL_LAYOUT,
    PER_RANK,
    RESHARDABLE,
    optimizer_layout,
    parallel_layout,
)
from mcore_rl.console import setup_actor
from mcore_rl.metrics import process_stats
from mcore_rl.trainer.logprobs import token_logprobs
from mcore_rl.trainer.offload import StorageOffloader
from mcore_rl.trainer.packing import pack_rows, plan_packing, plan_shared_prompts, share_prompt_rows
from mcore_rl.trainer.training import MegatronModel, MegatronTrainStep, microbatches, recompute_overrides
from models.bridge import INIT_SKIPPED
from models.registry import get_bridge
from parallel.comm import all_reduce_, all_reduce_scalar, in_row_shares
from parallel.device import Device
from parallel.groups import init_parallel

if TYPE_CHECKING:
    from mcore_rl.config.schema import CriticConfig, ReferenceConfig, RewardModelConfig, TrainerConfig

    ModelSection = TrainerConfig | ReferenceConfig | CriticConfig | RewardModelConfig

log = logging.getLogger(__name__)


class MegatronRank:
    """One rank of a Megatron model loaded from an HF directory, scoring sequences (the reference policy)."""

    def __init__(
        self,
        rank: int,
        world: int,
        master: tuple[str, int],
        section: ModelSection,
        seed: int,
        overrides: dict | None = None,
        cores: list[int] | None = None,
    ):
        """``section``: the role's config section; its HF directory (``load``), ``parallel`` layout, THD packing
        (``max_token_in_packing`` > 0) and ``share_prompts``: score (and train) each prompt's samples in one row
        that holds the prompt once (:func:`mcore_rl.trainer.packing.share_prompt_rows`; whole groups per
        data-parallel rank and step). ``overrides``: TransformerConfig fields beyond what the run config sets (a
        test's ``params_dtype``). ``cores``: the CPU cores of this rank's device, where roles on other devices run at
        the same time."""
        setup_actor()  # its output to its log file, its stacks for the hang watchdog
        os.environ.update(
            MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0"
        )
        self.machine = Device.current()
        self.machine.share_cores(world, cores)
        self.section, self.rank, self.parallel, self.seed = section, rank, section.parallel, seed
        self.max_token_in_packing = section.max_token_in_packing  # > 0: THD packs instead of padded micro-batches
        self.groups = init_parallel(self.parallel, seed=seed, device=self.machine)
        self.hf_dir, self.bridge = section.load, get_bridge(section.load)
        # built to be loaded (_build): Megatron's random init skipped
        fields = INIT_SKIPPED | self._model_overrides() | (overrides or {})
        self.config = self.bridge.transformer_config(self.parallel, **fields)
        self.share_prompts = section.share_prompts
        self.chunks = self._build(self.hf_dir)
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

    def answer(self, method: str, *args, **kwargs):
        """``method``'s result on rank 0, None on the others: where every rank computes the same result, the
        driver reads one copy (:meth:`~mcore_rl.roles.cluster.ActorGroup.ask`) and no other travels."""
        result = getattr(self, method)(*args, **kwargs)
        return result if self.rank == 0 else None

    @property
    def dp(self) -> tuple[int, int]:
        """Data-parallel size and rank: how the rows of a batch are shared (CP ranks of one DP rank share rows)."""
        group = self.groups.dp
        return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)

    def logprobs(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """Log-probs [N, L-1] of ``batch["tokens"]``; each DP rank scores its share, every rank gets all rows."""
        vocab = self.bridge.vocab_size
        return self._score(
            batch, micro_batch_size, lambda mb, output: token_logprobs(output, mb["labels"], vocab, self.groups.tp)
        )

    def _score(self, batch: dict, micro_batch_size: int, measure) -> torch.Tensor:
        """``measure`` (see :meth:`MegatronModel.score`) of every row of ``batch``, each DP rank scoring its share."""
        packing = self.max_token_in_packing
        if self.share_prompts:  # whole prompt groups, token-balanced: the ranks' shares differ in rows
            tokens = batch["tokens"].to(self.device)
            lengths, prompts = batch["lengths"].tolist(), batch["prompt_lengths"].tolist()
            plan = self._shared_plan(tokens, lengths, prompts, micro_batch_size)[self.dp[1]]
            local = self.model.score(
                tokens, measure, micro_batch_size, lengths, prompt_lengths=prompts, shared_plan=plan
            )
            return all_reduce_(local, self.groups.dp).cpu()  # each row is scored on one rank, 0 on the others

        def score(mine: dict) -> torch.Tensor:  # equal shares (a multi-turn trajectory's rewritten history adds rows)
            lengths = mine.pop("lengths").tolist() if packing else None
            mine = {k: v.to(self.device) for k, v in mine.items()}
            tokens = mine.pop("tokens")
            return self.model.score(tokens, measure, micro_batch_size, lengths, packing, **mine)

        keys = ("tokens", *self._routing(batch)) + (("lengths",) if packing else ())
        return in_row_shares(score, {k: batch[k] for k in keys}, self.groups.dp).cpu()

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
        section: TrainerConfig | CriticConfig,
        seed: int,
        total_steps: int,
        overrides: dict | None = None,
        cores: list[int] | None = None,
    ):
        """:class:`MegatronRank`'s arguments; the section's ``optimizer``, its LR schedule over ``total_steps``, and
        its ``recompute``: ``"full"`` recomputes each layer's activations in the backward (``recompute_overrides``)."""
        super().__init__(rank, world, master, section, seed, overrides, cores)
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        settings = dataclasses.asdict(section.optimizer)
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
        """The section's recomputation; linears that add their weight gradients into DDP's buffer in the GEMM
        (``gradient_accumulation_fusion``, through compat.megatron_core.accumulate_in_main_grads without Apex)."""
        return recompute_overrides(self.section.recompute) | {"gradient_accumulation_fusion": True}

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
    def _sharded_state(self, is_loading: bool, layout: str) -> dict:
        """Model, optimizer (its state in Megatron's ``layout``: :data:`~mcore_rl.checkpoint.PER_RANK` or
        :data:`~mcore_rl.checkpoint.RESHARDABLE`) and LR schedule as Megatron's sharded state dict."""
        model = model_state(self.chunks)
        metadata = {"distrib_optim_sharding_type": layout}
        optimizer = self.model.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=metadata)
        return {**model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def save(self, directory: str, reshardable: bool = False) -> None:
        """Model, optimizer and LR schedule as a Megatron distributed checkpoint in ``directory/checkpoint_dir``. The
        optimizer's state as each rank holds it (every rank writes its own at once; it loads under the same layout
        only), or, ``reshardable``, gathered to data-parallel rank 0 and written per parameter (it loads under any
        layout; SmolLM2 at DP 2 on 2 CPU cores: 16.9 s instead of 2.9 s, ``python -m benchmarks checkpoint``)."""
        from megatron.core import dist_checkpointing

        layout = RESHARDABLE if reshardable else PER_RANK
        path = Path(directory) / self.checkpoint_dir
        path.mkdir(exist_ok=True)
        content = {
            OPTIMIZER_LAYOUT: layout,
            PARALLEL_LAYOUT: parallel_layout(self.parallel, torch.distributed.get_world_size()),
        }
        dist_checkpointing.save(self._sharded_state(False, layout), str(path), content_metadata=content)

    def load(self, directory: str) -> None:
        from megatron.core import dist_checkpointing
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        path = str(Path(directory) / self.checkpoint_dir)
        layout = optimizer_layout(path, parallel_layout(self.parallel, torch.distributed.get_world_size()))
        for opt in self._optimizers():
            if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()  # Adam's state exists only after a step otherwise
        state = dist_checkpointing.load(self._sharded_state(True, layout), path)
        for i, chunk in enumerate(self.chunks):
            chunk.load_state_dict(state[f"model{i}"])
        self.model.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def optimizer_digest(self) -> dict:
        """Step count and sums of Adam's moments over all ranks: equal before a save and after its load. The signed
        first moments' sum cancels (to about a hundredth of their magnitudes in the tests' models), so their
        magnitudes' sum (``exp_avg_abs``) is the scale a comparison of it is relative to."""
        step, sums = 0.0, {"exp_avg": 0.0, "exp_avg_abs": 0.0, "exp_avg_sq": 0.0}
        for opt in self._optimizers():
            for state in opt.optimizer.state.values():
                step = max(step, float(state.get("step", 0)))
                if "exp_avg" in state:
                    sums["exp_avg"] += state["exp_avg"].double().sum().item()
                    sums["exp_avg_abs"] += state["exp_avg"].double().abs().sum().item()
                if "exp_avg_sq" in state:
                    sums["exp_avg_sq"] += state["exp_avg_sq"].double().sum().item()
        world = torch.distributed.group.WORLD
        return {"step": all_reduce_scalar(step, world, "max")} | {
            k: all_reduce_scalar(v, world) for k, v in sums.items()
        }
