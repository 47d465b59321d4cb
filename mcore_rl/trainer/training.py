"""Megatron-Core models driven by Megatron's pipeline schedules: forward-only scoring and optimisation steps.

``MegatronModel`` scores sequences (reference model, post-sync probe); ``MegatronTrainStep`` adds Megatron's DDP
and optimizer. The loss is a callable so algorithm math stays outside (pure functions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from compat.megatron_core import (
    accumulate_weight_grads,
    expert_norms_by_expert_tp,
    fuse_torch_adam,
    release_dispatcher_graphs,
)
from compat.torch import optimizers_without_compiler
from mcore_rl.trainer.logprobs import token_logprobs
from mcore_rl.trainer.moe import end_replay, replay_routing
from mcore_rl.trainer.packing import pack_rows, plan_packing, rows_of, share_prompt_rows, to_width
from parallel.comm import all_gather_objects, all_reduce_, broadcast_bucket
from parallel.context import shard_micro_batch
from parallel.device import Device

# loss_fn(batch, logits) -> (scalar loss to differentiate, {metric name: detached value})
LossFn = Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over micro-batches and data-parallel ranks, on every rank
    grad_norm: float
    update_successful: bool
    metrics: dict[str, float]  # the loss function's metrics, averaged like ``loss``


def microbatches(tokens: torch.Tensor, micro_batch_size: int, align: int, **extra: torch.Tensor) -> list[dict]:
    """Split ``tokens`` [b, s] into next-token micro-batches: input_ids/labels/position_ids [mb, s-1+pad].

    ``extra`` tensors are split along the batch too; per-position ones ([b, s-1, ...], aligned with labels) are
    right padded with zeros like the labels. The padding makes the length divisible by ``align`` (see
    ``MegatronModel.align``); causal scores of the real positions do not change.
    """
    length = tokens.shape[1] - 1
    pad = -length % align
    padded = torch.nn.functional.pad(tokens, (0, pad))
    positions = torch.arange(length + pad, device=tokens.device)
    extra = {k: to_width(v, length + pad) if v.dim() >= 2 else v for k, v in extra.items()}
    out = []
    for start in range(0, tokens.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        mb = padded[rows]
        batch = {"input_ids": mb[:, :-1], "labels": mb[:, 1:], "position_ids": positions.expand(mb.shape[0], -1)}
        out.append(batch | {k: v[rows] for k, v in extra.items()})
    return out


def recompute_overrides(mode: str) -> dict:
    """TransformerConfig fields for ``models.policy_trainer.recompute``: ``"full"`` checkpoints every layer (its
    input is kept; the rest is recomputed in the backward), ``"none"`` keeps every activation."""
    return (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if mode == "full" else {}
    )


@contextlib.contextmanager
def shared_prompt_forward(model: torch.nn.Module, batch: dict, tp_group):
    """A shared-prompt row (:func:`mcore_rl.trainer.packing.share_prompt_rows`) through Megatron's ``GPTModel``: rotary
    embeddings at the row's position ids (``GPTModel`` rotates by place in the row) and the LM head only at the
    positions that predict response tokens (``output_index``). Under sequence parallelism the LM head's input is
    gathered first, as Megatron's own last-token inference path does, with a gradient that keeps this rank's part
    of the already reduced input gradient. Plain batches pass through."""
    if "output_index" not in batch:
        yield
        return
    gpt = next(m for m in model.modules() if isinstance(m, GPTModel))
    positions = batch["position_ids"][0]
    handles = []
    if getattr(gpt, "rotary_pos_emb", None) is not None:
        rope = gpt.rotary_pos_emb
        handles.append(rope.register_forward_hook(lambda m, a, out: m.get_emb(int(positions.max()) + 1)[positions]))
    layer = gpt.output_layer if gpt.post_process else None
    sequence_parallel = layer is not None and layer.sequence_parallel

    def select(module, args):
        hidden = args[0]
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=tp_group)
        return (hidden[batch["output_index"]], *args[1:])

    if layer is not None:
        handles.append(layer.register_forward_pre_hook(select))
        layer.sequence_parallel = False
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if layer is not None:
            layer.sequence_parallel = sequence_parallel


class MegatronModel:
    """This rank's model chunks (plain or DDP-wrapped) and the schedule that runs them over micro-batches."""

    def __init__(self, chunks: list[torch.nn.Module], groups: ProcessGroupCollection):
        self.model = chunks
        self.groups = groups
        self.cp = torch.distributed.get_world_size(groups.cp)
        # Sequence lengths must split over TP (sequence parallelism) and into 2 x CP chunks (context parallelism).
        self.align = torch.distributed.get_world_size(groups.tp) * (2 * self.cp if self.cp > 1 else 1)
        # Megatron's interleaved (VPP) schedule runs micro-batches in groups of PP.
        self.micro_batch_multiple = torch.distributed.get_world_size(groups.pp) if len(chunks) > 1 else 1

    def _loss(self, loss_fn: LossFn, batch: dict, output: torch.Tensor):
        loss, metrics = loss_fn(batch, output)
        # Under CP the loss function sees whole sequences (gathered by ``rows_of``), the same loss on every CP
        # rank; Megatron's schedule multiplies by CP, expecting each rank's share of it, so the loss is divided
        # here. (Megatron also divides the returned loss in place; metrics must not alias it.)
        return loss / self.cp, {name: value.detach().clone() for name, value in metrics.items()}

    def _forward(self, loss_fn: LossFn, data_iterator, model):
        batch = next(data_iterator)
        if self.cp > 1:
            batch = shard_micro_batch(batch, self.groups.cp)
        if "routed_experts" in batch:
            replay_routing(model, batch, self.groups)
        with shared_prompt_forward(model, batch, self.groups.tp):
            output = model(
                batch["input_ids"],
                batch["position_ids"],
                batch.get("attention_mask"),
                packed_seq_params=batch.get("packed_seq_params"),
            )
        return output, partial(self._loss, loss_fn, batch)

    def _schedule(self, microbatches: list[dict], loss_fn: LossFn, forward_only: bool) -> list[dict]:
        """Megatron's pipeline schedule over the micro-batches; metrics exist on the last stage only. Packed and
        shared-prompt micro-batches differ in length: pipeline stages then exchange shapes first
        (``variable_seq_lengths``).
        Under CP each rank computes its share of the whole sequences given here (``shard_micro_batch``); with
        ``routed_experts`` in the micro-batches the routers replay them (:func:`~.moe.replay_routing`)."""
        batch_size, seq_length = microbatches[0]["input_ids"].shape  # Megatron divides by CP itself
        data = [iter(microbatches) for _ in self.model]
        config = self.model[0].config
        config.variable_seq_lengths = len({mb["input_ids"].shape for mb in microbatches}) > 1
        try:
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward, loss_fn),
                data_iterator=data if len(data) > 1 else data[0],
                model=self.model,
                num_microbatches=len(microbatches),
                seq_length=seq_length,
                micro_batch_size=batch_size,
                forward_only=forward_only,
            )
        finally:
            if "routed_experts" in microbatches[0]:
                end_replay(self.model)
            release_dispatcher_graphs(self.model)

    def logprobs(self, tokens: torch.Tensor, vocab_size: int, micro_batch_size: int, *args, **kwargs) -> torch.Tensor:
        """log p(tokens[:, i] | tokens[:, :i]) for i >= 1, shape [b, s-1], on every rank (fp32); the other arguments
        are :meth:`score`'s."""

        def measure(batch, output):
            return token_logprobs(output, batch["labels"], vocab_size, self.groups.tp)

        return self.score(tokens, measure, micro_batch_size, *args, **kwargs)

    @torch.no_grad()
    def score(
        self,
        tokens: torch.Tensor,
        measure: Callable[[dict, torch.Tensor], torch.Tensor],
        micro_batch_size: int,
        lengths: list[int] | None = None,
        max_tokens: int = 0,
        prompt_lengths: list[int] | None = None,
        shared_plan: list[list[list[int]]] | None = None,
        **extra: torch.Tensor,
    ) -> torch.Tensor:
        """``measure(micro-batch, model output)`` per input position ([b, s] of the micro-batch's layout) for every
        row of ``tokens``: shape [b, s-1], on every rank (fp32).

        ``max_tokens`` > 0: the rows (``lengths`` real tokens each) are scored in THD packs of at most that many
        tokens (:mod:`mcore_rl.trainer.packing`) instead of padded micro-batches; positions past a row's length are not
        the sample's (callers mask them). ``shared_plan`` (with ``lengths`` and ``prompt_lengths``): only these
        micro-batches of prompt groups (:func:`~.packing.plan_shared_prompts`) are scored, in shared-prompt
        rows (:func:`mcore_rl.trainer.packing.share_prompt_rows`), and only at response positions; everything else is 0.
        Under interleaved pipelining Megatron's schedule needs a multiple of PP micro-batches, so a batch given as
        one micro-batch (the post-sync probe) is split further: into the largest equal size that makes PP of them.
        ``extra``: per-row model inputs besides the tokens (``routed_experts`` to replay).
        """
        length, align, multiple = tokens.shape[1] - 1, self.align, self.micro_batch_multiple
        pp = torch.distributed.get_world_size(self.groups.pp)
        order = list(range(tokens.shape[0]))
        if shared_plan is not None:
            batches = [share_prompt_rows(tokens, lengths, prompt_lengths, mb, align, **extra) for mb in shared_plan]
            order = [i for mb in shared_plan for group in mb for i in group]
        elif max_tokens:
            plan = plan_packing([n - 1 for n in lengths], max_tokens, 1, align=align, multiple=multiple)
            batches = [pack_rows(tokens, lengths, mb, align, **extra) for mb in plan.ranks[0]]
            order = [i for mb in plan.ranks[0] for i in mb]
        else:
            if multiple > 1:
                limit = max(1, min(micro_batch_size, tokens.shape[0] // multiple))
                micro_batch_size = max(d for d in range(1, limit + 1) if tokens.shape[0] % d == 0)
            batches = microbatches(tokens, micro_batch_size, align, **extra)

        def per_row(batch, output):
            values = rows_of(batch, measure(batch, output).float())
            values = torch.nn.functional.pad(values, (0, max(0, length - values.shape[1])))
            return values.sum() * 0, {"values": values[:, :length]}

        for chunk in self.model:
            chunk.eval()
        try:
            outputs = self._schedule(batches, per_row, forward_only=True)
        finally:
            for chunk in self.model:
                chunk.train()
        is_last = torch.distributed.get_rank(self.groups.pp) == pp - 1
        local = None
        if is_last:
            local = [torch.zeros(tokens.shape[0], length, device=tokens.device)]
            local[0][order] = torch.cat([o["values"] for o in outputs])
        shape = torch.Size([tokens.shape[0], length])
        return broadcast_bucket(local, [shape], torch.float32, pp - 1, self.groups.pp, tokens.device)[0]


class MegatronTrainStep(MegatronModel):
    """Adds Megatron's DDP wrapping and (distributed) optimizer; ``step`` runs one update."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        config: TransformerConfig,
        optimizer: OptimizerConfig,
        groups: ProcessGroupCollection,
        device: Device | None = None,
    ):
        """``device``: whose choices the optimizer follows (this machine's unless given)."""
        device = device or Device.current()
        # The data-parallel mean in the collective (AVG): no pass of its own over the whole gradient buffer before
        # the reduction, as Megatron's default 1/DP pre-scaling costs (parallel.shm folds it into its copies)
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=optimizer.use_distributed_optimizer,
            average_in_collective=True,
        )
        wrapped = [
            DistributedDataParallel(config, ddp, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)
        ]
        super().__init__(wrapped, groups)
        if config.gradient_accumulation_fusion:  # the linears write their buffers: the embeddings too
            accumulate_weight_grads(self.model)
        config.finalize_model_grads_func = finalize_model_grads
        optimizers_without_compiler()  # torch's Adam imports the compiler for nothing (compat.torch)
        self.optimizer = get_megatron_optimizer(optimizer, self.model, pg_collection=groups, **device.optimizer_args())
        expert_norms_by_expert_tp(self.optimizer, groups.expt_tp)
        fuse_torch_adam(self.optimizer)

    def step(self, microbatches: list[dict], loss_fn: LossFn) -> StepResult:
        """Forward/backward over ``microbatches`` (dicts with input_ids/position_ids [b, s] and loss inputs)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._schedule(microbatches, loss_fn, forward_only=False)
        update_successful, grad_norm, _ = self.optimizer.step()
        metrics = self._mean_metrics(outputs)
        return StepResult(
            loss=metrics.pop("loss"),
            grad_norm=float(grad_norm),
            update_successful=bool(update_successful),
            metrics=metrics,
        )

    def _mean_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Average the metrics over micro-batches and data-parallel ranks (one all-reduce), then hand the last
        pipeline stage's result to every stage (only it computes losses)."""
        local = None
        if outputs:  # the last pipeline stage
            names = sorted(outputs[0])
            values = torch.stack([torch.stack([o[n].float().mean() for n in names]) for o in outputs]).mean(0)
            dp = self.groups.dp_cp
            values = all_reduce_(values.double(), dp) / torch.distributed.get_world_size(dp)
            local = dict(zip(names, values.tolist(), strict=True))
        return all_gather_objects(local, self.groups.pp)[-1]
