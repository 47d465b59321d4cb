"""Megatron-Core models driven by Megatron's pipeline schedules: forward-only scoring and optimisation steps.

``MegatronModel`` scores sequences (reference model, post-sync probe); ``MegatronTrainStep`` adds Megatron's DDP
and optimizer. The loss is a callable so algorithm math stays outside (pure functions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_rl.logprobs import token_logprobs
from parallel.comm import all_reduce_scalar, broadcast_bucket

# loss_fn(batch, logits) -> (scalar loss to differentiate, {metric name: detached value})
LossFn = Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over micro-batches and data-parallel ranks, on every rank
    grad_norm: float
    update_successful: bool


class MegatronModel:
    """This rank's model chunks (plain or DDP-wrapped) and the schedule that runs them over micro-batches."""

    def __init__(self, chunks: list[torch.nn.Module], groups: ProcessGroupCollection):
        self.model = chunks
        self.groups = groups

    @staticmethod
    def _loss(loss_fn: LossFn, batch: dict, output: torch.Tensor):
        loss, metrics = loss_fn(batch, output)
        # Megatron's schedule divides the returned loss in place; metrics must not alias it.
        return loss, {name: value.detach().clone() for name, value in metrics.items()}

    @classmethod
    def _forward(cls, loss_fn: LossFn, data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["input_ids"], batch["position_ids"], None)
        return output, partial(cls._loss, loss_fn, batch)

    def _schedule(self, microbatches: list[dict], loss_fn: LossFn, forward_only: bool) -> list[dict]:
        """Megatron's pipeline schedule over equally-shaped micro-batches; metrics exist on the last stage only."""
        batch_size, seq_length = microbatches[0]["input_ids"].shape
        data = [iter(microbatches) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward, loss_fn),
            data_iterator=data if len(data) > 1 else data[0],
            model=self.model,
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=batch_size,
            forward_only=forward_only,
        )

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor, vocab_size: int, micro_batch_size: int) -> torch.Tensor:
        """log p(tokens[:, i] | tokens[:, :i]) for i >= 1, shape [b, s-1], on every rank (fp32)."""
        length = tokens.shape[1] - 1
        # Sequence parallelism splits the sequence over TP ranks; right padding leaves causal scores unchanged.
        pad = -length % torch.distributed.get_world_size(self.groups.tp)
        padded = torch.nn.functional.pad(tokens, (0, pad))
        positions = torch.arange(length + pad, device=tokens.device).expand(micro_batch_size, -1)
        microbatches = [
            {"input_ids": mb[:, :-1], "labels": mb[:, 1:], "position_ids": positions}
            for mb in padded.split(micro_batch_size)
        ]

        def score(batch, output):
            logprobs = token_logprobs(output, batch["labels"], vocab_size)
            return logprobs.sum() * 0, {"logprobs": logprobs[:, :length]}

        for chunk in self.model:
            chunk.eval()
        try:
            outputs = self._schedule(microbatches, score, forward_only=True)
        finally:
            for chunk in self.model:
                chunk.train()
        pp = torch.distributed.get_world_size(self.groups.pp)
        is_last = torch.distributed.get_rank(self.groups.pp) == pp - 1
        local = [torch.cat([o["logprobs"] for o in outputs])] if is_last else None
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
    ):
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=optimizer.use_distributed_optimizer
        )
        wrapped = [
            DistributedDataParallel(config, ddp, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)
        ]
        super().__init__(wrapped, groups)
        config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            optimizer, self.model, use_gloo_process_groups=torch.cuda.is_available(), pg_collection=groups
        )

    def step(self, microbatches: list[dict], loss_fn: LossFn) -> StepResult:
        """Forward/backward over ``microbatches`` (dicts with input_ids/position_ids [b, s] and loss inputs)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._schedule(microbatches, loss_fn, forward_only=False)
        update_successful, grad_norm, _ = self.optimizer.step()
        # Only the last pipeline stage sees losses (others contribute 0); share their DP mean with every rank.
        local = sum(float(m["loss"]) for m in losses) / len(microbatches)
        dp_mean = all_reduce_scalar(local, self.groups.dp_cp) / torch.distributed.get_world_size(self.groups.dp_cp)
        loss = all_reduce_scalar(dp_mean, self.groups.pp)
        return StepResult(loss=loss, grad_norm=float(grad_norm), update_successful=bool(update_successful))
