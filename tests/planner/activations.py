"""What autograd saves for backward in one training forward, measured per layer: the reference the memory planner's
activation estimate is checked against (runs on every rank of the test pool)."""

from __future__ import annotations

from collections import defaultdict

import torch

from mcore_rl.trainer.logprobs import token_logprobs
from mcore_rl.trainer.packing import pack_rows
from parallel.context import shard_micro_batch
from tests.distributed.cases import _grouped_kernel, _load


def saved_bytes(hf_dir: str, layout: dict, lengths: list[int], seed: int = 0) -> dict[str, int]:
    """Bytes of the distinct non-parameter storages autograd saves during the forward and loss of one packed
    micro-batch of sequences of ``lengths``, by owner: ``layer<i>`` (global index), ``head`` (final norm, output
    layer and loss) and ``other``; and the micro-batch's ``tokens`` and ``sequence`` (mean length)."""
    bridge, _, chunks, groups = _load(hf_dir, layout)
    _grouped_kernel(chunks)  # the experts' path the planner counts: GPUs' (the loop, on CPU, saves no stacked copy)
    (model,) = chunks
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    owner, seen = ["other"], {}
    offset = model.decoder.layers[0].layer_number - 1
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: owner.__setitem__(0, f"layer{offset + i}"))
    if model.post_process:
        model.decoder.final_layernorm.register_forward_pre_hook(lambda *_: owner.__setitem__(0, "head"))

    def pack_hook(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen.setdefault(storage.data_ptr(), (owner[0], storage.nbytes()))
        # Not the tensor itself: a node that saves its own output would hold it with its grad_fn, a cycle through
        # C++ that the collector cannot free (it kept the model and a process group alive after every case).
        return tensor.detach()

    torch.manual_seed(seed)
    tokens = torch.randint(4, bridge.vocab_size, (len(lengths), max(lengths)))
    tp = torch.distributed.get_world_size(groups.tp)
    cp = torch.distributed.get_world_size(groups.cp)
    batch = pack_rows(tokens, lengths, list(range(len(lengths))), tp * (2 * cp if cp > 1 else 1))
    params = batch["packed_seq_params"]
    bounds = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    lengths = bounds.diff().tolist()
    # tokens of the micro-batch (before any CP split), and their token-weighted mean sequence length
    totals = defaultdict(int, tokens=batch["input_ids"].numel(), sequence=sum(n * n for n in lengths) / sum(lengths))
    if cp > 1:
        batch = shard_micro_batch(batch, groups.cp)
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda tensor: tensor):
        output = model(batch["input_ids"], batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])
        if model.post_process:
            token_logprobs(output, batch["labels"], bridge.vocab_size, groups.tp)
    for name, nbytes in seen.values():
        totals[name] += nbytes
    return dict(totals)


def params_per_rank(hf_dir: str, layout: dict) -> tuple[int, int, int, int]:
    """(pipeline rank, parameters, expert parameters, parameter tensors) this rank's Megatron model holds."""
    _, _, chunks, groups = _load(hf_dir, layout)
    params = [p for chunk in chunks for p in chunk.parameters()]
    experts = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    return torch.distributed.get_rank(groups.pp), sum(p.numel() for p in params), experts, len(params)


def lora_params_per_rank(
    hf_dir: str, layout: dict, targets: list[str], train_router: bool
) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(pipeline rank, (LoRA adapter parameters of rank 8 on ``targets``, of which expert-parallel), (the model's
    parameters that train beside them, the elements of the routers' copies)) this rank's Megatron model holds."""
    from models.lora import LoRAConfig, adapters, attach_lora, router_copies

    _, _, chunks, groups = _load(hf_dir, layout)
    attach_lora(chunks, LoRAConfig(rank=8, targets=targets, train_router=train_router), seed=0, tp_group=groups.tp)
    params = [p for a in adapters(chunks).values() for p in a.parameters()]
    experts = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    trained = sum(p.numel() for c in chunks for n, p in c.named_parameters() if p.requires_grad and "lora." not in n)
    copies = sum(b.numel() for c in router_copies(chunks).values() for b in c.buffers())
    return torch.distributed.get_rank(groups.pp), (sum(p.numel() for p in params), experts), (trained, copies)
