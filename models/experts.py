"""Routed experts as grouped matrix multiplies: all local experts in two ``torch.nn.functional.grouped_mm`` calls.

:class:`GroupedExperts` is Megatron's ``SequentialMLP`` with another forward: it keeps the per-expert ``MLP``
modules, so parameter names, TP/EP sharding, dist-checkpoint keys and HF mappings are the sequential experts'
(checkpoints and the rollout sync do not care which one ran). The forward stacks the local experts' weights
(one copy per step, the size of the local expert weights) and runs ``fc1`` and ``fc2`` as one grouped GEMM each
over the tokens sorted by expert (biases, and the activation's clamp and offset, as Megatron's ``MLP`` applies them), instead of a Python loop of ``2 * num_local_experts`` small GEMMs, where that is
the faster of the two (:meth:`parallel.device.Device.grouped_experts`); else it is the loop. The experts' LoRA
adapters, where a run trains them, add theirs per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from parallel.device import Device

# grouped_mm needs every row stride (hence the output width) to be a multiple of 16 bytes.
_ALIGN_BYTES = 16


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward rejects stride-0
    gradients (as ``.sum()`` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[i-1]:offsets[i]`` of ``x`` [T, in] times ``weights[i]``ᵀ ([E, out, in]) -> [T, out]."""
    return _ContiguousGrad.apply(F.grouped_mm(x, weights.transpose(-2, -1), offs=offsets))


def has_bias(linear: torch.nn.Module) -> bool:
    """Whether a linear layer adds a bias: Megatron's local linears built without one keep ``None``,
    TransformerEngine's an empty tensor (Megatron-Core's TE extension reads both as no bias)."""
    bias = getattr(linear, "bias", None)
    return isinstance(bias, torch.Tensor) and bias.numel() > 0


class GroupedExperts(SequentialMLP):
    """``SequentialMLP``'s parameters and state dict; one grouped GEMM per projection where ``grouped_kernel``
    (the device's choice for this many local experts; tests set it to check the kernel where it is not chosen),
    else ``SequentialMLP``'s loop."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection)
        self.grouped_kernel = Device.current().grouped_experts(num_local_experts)
        fc1, fc2 = self.local_experts[0].linear_fc1.weight, self.local_experts[0].linear_fc2.weight
        per_row = _ALIGN_BYTES // fc1.element_size()
        if fc1.shape[0] % per_row or fc2.shape[0] % per_row or fc2.shape[1] % per_row:
            raise ValueError(
                f"grouped experts need hidden_size and moe_ffn_hidden_size/expert-TP (here fc1 {tuple(fc1.shape)}, "
                f"fc2 {tuple(fc2.shape)}) to be multiples of {per_row} for {fc1.dtype}; use sequential experts "
                "(moe_grouped_gemm=False)"
            )

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        """``hidden`` [T, h] sorted by local expert, ``tokens_per_expert`` [E], ``probs`` [T] -> ([T, h], None)."""
        if self.grouped_kernel:
            return self.grouped_forward(hidden, tokens_per_expert, probs)
        return super().forward(hidden, tokens_per_expert, probs)

    def grouped_forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        """:meth:`forward` as grouped GEMMs, whichever the device's choice (only ``SequentialMLP``'s attributes are
        read: tests and the benchmark call it on either module)."""
        if self.config.moe_apply_probs_on_input:
            hidden = probs.unsqueeze(-1).to(hidden.dtype) * hidden
            probs = torch.ones_like(probs)
        counts = tokens_per_expert.to(hidden.device)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])
        intermediate = _with_lora(self, "linear_fc1", hidden, grouped_linear(hidden, fc1, offsets), tokens_per_expert)
        if (bias := _expert_bias(self, "linear_fc1", counts, hidden.shape[0])) is not None:
            intermediate = intermediate + bias
        intermediate = (activate(self.config, intermediate) * probs.unsqueeze(-1)).to(hidden.dtype)
        out = _with_lora(
            self, "linear_fc2", intermediate, grouped_linear(intermediate, fc2, offsets), tokens_per_expert
        )
        if (bias := _expert_bias(self, "linear_fc2", counts, hidden.shape[0])) is not None:
            out = out + (bias * probs.unsqueeze(-1)).to(out.dtype)  # weighted as the expert's output (mlp.py:242)
        return out, None


def _expert_bias(experts: SequentialMLP, name: str, counts: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Each row's expert's bias of projection ``name`` [rows, out], or None without biases."""
    linears = [getattr(e, name) for e in experts.local_experts]
    if not has_bias(linears[0]):
        return None
    return torch.stack([linear.bias for linear in linears]).repeat_interleave(counts, dim=0, output_size=rows)


def activate(config, x: torch.Tensor) -> torch.Tensor:
    """Megatron's expert activation (mlp.py:215): of ``[gate | linear]`` under a gated linear unit,
    ``act(gate) * (linear + glu_linear_offset)``, gate clamped above and linear both ways at
    ``activation_func_clamp_value`` where set (gpt-oss's). Without them ``linear`` stays a view of ``x`` (what the
    product keeps for backward: no second copy)."""
    if not config.gated_linear_unit:
        return config.activation_func(x)
    gate, linear = x.chunk(2, dim=-1)
    if (limit := config.activation_func_clamp_value) is not None:
        gate, linear = gate.clamp(max=limit), linear.clamp(-limit, limit)
    if config.glu_linear_offset:
        linear = linear + config.glu_linear_offset
    return config.activation_func(gate) * linear


def _with_lora(experts: SequentialMLP, name: str, x: torch.Tensor, out: torch.Tensor, tokens_per_expert: torch.Tensor):
    """``out`` of the experts' projection ``name`` plus their LoRA adapters' (models/lora.py: the hooks they put on
    the expert linears never run in a grouped forward), each over its expert's rows of ``x``."""
    adapters = [getattr(getattr(e, name), "lora_adapter", [None])[0] for e in experts.local_experts]
    if adapters[0] is None or not adapters[0].enabled:
        return out
    parts = x.split(tokens_per_expert.tolist())
    return out + torch.cat([a.delta(part) for a, part in zip(adapters, parts, strict=True)])
