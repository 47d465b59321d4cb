"""Functions that run on every rank of the pool (see pool.py); each builds its own layout and returns plain data."""

from __future__ import annotations

import os
import traceback
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.moe.experts import SequentialMLP

from converters.hf_io import HFCheckpoint
from converters.mapping import MappingTable
from converters.plan import local_params
from converters.stream import export_hf, load_weights
from converters.transforms import full_shape, shard
from mcore_rl.trainer.logprobs import token_logprobs
from mcore_rl.trainer.training import MegatronModel, MegatronTrainStep
from models.bridge import INIT_SKIPPED
from models.experts import GroupedExperts
from models.registry import get_bridge
from parallel.config import ParallelConfig
from parallel.device import Device
from parallel.groups import init_parallel


def _policy_trainer(hf_dir: str, layout: dict, total_steps: int, lr: float = 1e-3, overrides=None, **fields):
    """This pool rank's policy-trainer rank on ``hf_dir`` in ``layout`` (the rest of its section: ``fields``)."""
    from mcore_rl.config.schema import OptimizerSettings, TrainerConfig
    from mcore_rl.trainer.policy import PolicyTrainer

    section = TrainerConfig(
        load=hf_dir, parallel=ParallelConfig(**layout), optimizer=OptimizerSettings(lr=lr), **fields
    )
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return PolicyTrainer(rank, world, ("127.0.0.1", 0), section, 1, total_steps, overrides=overrides)


def _critic(hf_dir: str, layout: dict, total_steps: int, optimizer=None, **fields):
    """This pool rank's critic rank on ``hf_dir`` in ``layout``, padded micro-batches unless ``fields`` say."""
    from mcore_rl.config.schema import CriticConfig, OptimizerSettings
    from mcore_rl.trainer.value import ValueTrainer

    fields = dict(max_token_in_packing=0, share_prompts=False) | fields
    optimizer = optimizer or OptimizerSettings(lr=1e-3)
    section = CriticConfig(load=hf_dir, parallel=ParallelConfig(**layout), optimizer=optimizer, **fields)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return ValueTrainer(rank, world, ("127.0.0.1", 0), section, 1, total_steps)


def _load(hf_dir: str, layout: dict, **overrides):
    parallel = ParallelConfig(**layout)
    groups = init_parallel(parallel)
    bridge = get_bridge(hf_dir)
    config = bridge.transformer_config(parallel, **(INIT_SKIPPED | overrides))  # loaded next, as the roles'
    chunks = bridge.build_model(config)
    load_weights(chunks, bridge, hf_dir, groups)
    return bridge, config, chunks, groups


def roundtrip(hf_dir: str, layout: dict, bucket_bytes: int, reference: str | None = None) -> int:
    """HF (or a converted Megatron checkpoint) -> Megatron(layout) -> HF on every rank; asserts every tensor is
    bit-identical to ``reference`` (default: ``hf_dir``'s); returns the count."""
    bridge, _, chunks, groups = _load(hf_dir, layout)
    ckpt = HFCheckpoint(reference or hf_dir)
    expected = {n for n in ckpt.names() if not bridge.ignores(n)}
    seen = set()
    for name, tensor in export_hf(chunks, bridge, groups, bucket_bytes=bucket_bytes):
        assert name not in seen, f"{name} exported twice"
        seen.add(name)
        reference = ckpt.get(name)
        assert tensor.dtype == reference.dtype and torch.equal(tensor, reference), f"{name} differs"
    assert seen == expected, f"missing {sorted(expected - seen)}, extra {sorted(seen - expected)}"
    return len(seen)


def _full_vocab(local: torch.Tensor, groups, vocab_size: int) -> torch.Tensor:
    """Concatenate the TP ranks' vocabulary shards of ``local`` logits and drop Megatron's padding."""
    shards = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(groups.tp))]
    torch.distributed.all_gather(shards, local.contiguous(), group=groups.tp)
    return torch.cat(shards, dim=-1)[..., :vocab_size]


def logits(hf_dir: str, layout: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [b, s, V] of a single-stage layout (TP shards gathered), on every rank."""
    bridge, _, chunks, groups = _load(hf_dir, layout)
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        local = chunks[0](input_ids, positions, None)
    return _full_vocab(local, groups, bridge.vocab_size)


def _adam_step(hf_dir: str, layout: dict, tokens: torch.Tensor, micro_batch_size: int, device=None, **overrides):
    """One Adam step on ``tokens`` ([global_batch, seq+1]) split over DP ranks, the model built with ``overrides``:
    the model's chunks and the step's result."""
    bridge, config, chunks, groups = _load(hf_dir, layout, **overrides)
    optimizer = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, use_distributed_optimizer=True)
    step = MegatronTrainStep(chunks, config, optimizer, groups, Device(device, None) if device else None)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    mine = tokens.chunk(dp)[dp_rank]
    positions = torch.arange(mine.shape[1] - 1).expand(micro_batch_size, -1)
    microbatches = [
        {"input_ids": mb[:, :-1], "labels": mb[:, 1:], "position_ids": positions} for mb in mine.split(micro_batch_size)
    ]

    def loss_fn(batch, output):
        loss = -token_logprobs(output, batch["labels"], bridge.vocab_size, groups.tp).mean()
        return loss, {"loss": loss.detach()}

    result = step.step(microbatches, loss_fn)
    assert result.update_successful
    return step.model, result


def train_step(
    hf_dir: str, layout: dict, tokens: torch.Tensor, micro_batch_size: int, device: str | None = None
) -> tuple[float, float]:
    """One Adam step (:func:`_adam_step`); returns (loss, grad norm). ``device``: the optimizer takes the arguments
    that device's branch gives (default: this machine's)."""
    _, result = _adam_step(hf_dir, layout, tokens, micro_batch_size, device)
    return result.loss, result.grad_norm


def accumulated_weight_grads_step(hf_dir: str, layout: dict, tokens: torch.Tensor, accumulate: bool) -> dict:
    """One Adam step (:func:`_adam_step`, micro-batches of one row) with the weight gradients written into DDP's
    buffers by the layers themselves (``accumulate``: the trained roles' models) or handed to autograd (Megatron's
    default): loss, grad norm, this rank's gradient buffers and parameters after it, and which embeddings
    accumulated."""
    from compat.megatron_core import _ACCUMULATES

    chunks, result = _adam_step(hf_dir, layout, tokens, 1, gradient_accumulation_fusion=accumulate)
    named = [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]
    return {
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "grads": {name: p.main_grad.clone() for name, p in named},
        "params": {name: p.detach().clone() for name, p in named},
        "accumulating": sorted(name for name, p in named if getattr(p, _ACCUMULATES, False)),
    }


def _grads_by_name(chunks) -> dict[str, torch.Tensor]:
    return {lp.slot: lp.param.grad.clone() for lp in local_params(chunks) if lp.param.grad is not None}


def _grouped_kernel(chunks) -> None:
    """Routed experts as grouped GEMMs also where the device would choose Megatron's loop (on CPU)."""
    for module in (m for chunk in chunks for m in chunk.modules() if isinstance(m, GroupedExperts)):
        module.grouped_kernel = True


def experts_grouped_vs_sequential(hf_dir: str, layout: dict, tokens: torch.Tensor) -> dict[str, float]:
    """Max |grouped - sequential| of: the loss, every parameter gradient of the whole model (same weights, both
    expert implementations); and of one experts module called directly with uneven and zero token counts. And the
    kernel choices of the grouped model as built (``chosen``)."""
    runs = []
    for grouped in (True, False):
        bridge, _, chunks, groups = _load(hf_dir, layout, moe_grouped_gemm=grouped)
        if grouped:  # the device's choice first (the loop, on CPU), then the kernel to compare
            chosen = {m.grouped_kernel for chunk in chunks for m in chunk.modules() if isinstance(m, GroupedExperts)}
            _grouped_kernel(chunks)
        positions = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
        loss = -token_logprobs(
            chunks[0](tokens[:, :-1], positions, None), tokens[:, 1:], bridge.vocab_size, groups.tp
        ).mean()
        loss.backward()
        runs.append((loss.detach(), _grads_by_name(chunks)))
    (loss_g, grads_g), (loss_s, grads_s) = runs
    assert grads_g.keys() == grads_s.keys() and any("local_experts" in n for n in grads_g)
    out = {
        "chosen": sorted(chosen),
        "loss": (loss_g - loss_s).abs().item(),
        "grads": max((grads_g[n] - grads_s[n]).abs().max().item() for n in grads_g),
    }

    # The grouped forward against SequentialMLP's on one module (the last model's): zero-token experts included.
    experts = next(m for m in chunks[0].modules() if isinstance(m, SequentialMLP))
    counts = torch.zeros(experts.num_local_experts, dtype=torch.long)
    counts[::2] = torch.arange(1, len(counts[::2]) + 1) * 3  # 3, 0, 6, 0, ...: uneven, with empty experts
    hidden = torch.randn(int(counts.sum()), experts.config.hidden_size, generator=torch.Generator().manual_seed(3))
    probs = torch.rand(hidden.shape[0], generator=torch.Generator().manual_seed(4))
    results = []
    for forward in (GroupedExperts.grouped_forward, SequentialMLP.forward):
        x = hidden.clone().requires_grad_()
        for param in experts.parameters():
            param.grad = None
        output, _ = forward(experts, x, counts, probs)
        output.sum().backward()  # a stride-0 gradient, which grouped_mm's backward cannot take directly
        results.append([output.detach(), x.grad, *[p.grad.clone() for p in experts.parameters()]])
    out["module"] = max((a - b).abs().max().item() for a, b in zip(*results, strict=True))
    return out


def context_parallel_scores(hf_dir: str, layout: dict, tokens: torch.Tensor, packed: bool = False):
    """Per-token log-probs [b, s-1] of the whole batch and the gradients of their sum, summed over CP ranks.

    Each CP rank feeds its load-balanced two chunks of every sequence (Megatron's split, which its RoPE
    assumes). ``packed``: the batch goes in as one THD pack with ``cu_seqlens`` (whole-sequence offsets).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    from parallel.context import load_balanced_positions

    bridge, _, chunks, groups = _load(hf_dir, layout)
    cp, cp_rank = torch.distributed.get_world_size(groups.cp), torch.distributed.get_rank(groups.cp)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    batch, length = ids.shape
    mine = load_balanced_positions(length, cp, cp_rank)
    if packed:
        cu = torch.arange(batch + 1, dtype=torch.int32) * length
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length, max_seqlen_kv=length
        )
        output = chunks[0](ids[:, mine].reshape(1, -1), mine.repeat(batch)[None], None, packed_seq_params=params)
        output = output.reshape(batch, len(mine), -1)
    else:
        output = chunks[0](ids[:, mine], mine.expand(batch, -1), None)
    local = token_logprobs(output, labels[:, mine], bridge.vocab_size, groups.tp)
    local.sum().backward()
    parts = [torch.empty_like(local) for _ in range(cp)]
    torch.distributed.all_gather(parts, local.detach().contiguous(), group=groups.cp)
    full = torch.empty(batch, length)
    for rank, part in enumerate(parts):
        full[:, load_balanced_positions(length, cp, rank)] = part
    grads = _grads_by_name(chunks)
    for grad in grads.values():
        torch.distributed.all_reduce(grad, group=groups.cp)
    return full, grads


def packed_vs_padded_step(hf_dir: str, layout: dict, tokens: torch.Tensor, lengths: list[int], packed: bool):
    """One Adam step on samples of different ``lengths`` (rows of ``tokens``), as padded micro-batches or as THD
    packs planned by :func:`plan_packing`; the loss sums masked log-probs, so it and the gradient do not depend
    on how samples are grouped. Returns (loss, grad norm, token utilisation of the plan)."""
    from mcore_rl.trainer.packing import pack_rows, plan_packing, rows_of
    from mcore_rl.trainer.training import microbatches

    bridge, config, chunks, groups = _load(hf_dir, layout)
    optimizer = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, use_distributed_optimizer=True)
    step = MegatronTrainStep(chunks, config, optimizer, groups)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    mask = (torch.arange(tokens.shape[1] - 1)[None] < torch.tensor(lengths)[:, None] - 1).float()
    utilization = 1.0
    if packed:
        plan = plan_packing([n - 1 for n in lengths], max_tokens=64, dp=dp, align=tp)
        mbs = [pack_rows(tokens, lengths, mb, tp, mask=mask) for mb in plan.ranks[dp_rank]]
        utilization = plan.utilization
    else:
        per_rank = tokens.shape[0] // dp
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        mbs = microbatches(tokens[rows], per_rank, tp, mask=mask[rows])

    def loss_fn(batch, output):
        logp = rows_of(batch, token_logprobs(output, batch["labels"], bridge.vocab_size, groups.tp))
        loss = -(logp * batch["mask"]).sum() / 8
        return loss, {"loss": loss.detach()}

    result = step.step(mbs, loss_fn)
    assert result.update_successful
    return len(mbs), result.loss, result.grad_norm, utilization


def greedy(hf_dir: str, layout: dict, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation computed by the Megatron model (full re-forward per token, TP logits gathered)."""
    bridge, _, chunks, groups = _load(hf_dir, layout)
    return _greedy(chunks, groups, bridge, prompt_ids, new_tokens)


def _greedy(chunks, groups, bridge, prompt_ids: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    for _ in range(new_tokens):
        with torch.no_grad():
            local = chunks[0](ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[:, -1]
        next_id = _full_vocab(local, groups, bridge.vocab_size).argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


def cuda_call_sites(case: str, **kwargs) -> list[str]:
    """Run another case with CUDA initialisation instrumented; returns the Megatron lines that reached CUDA.

    Every CUDA use on a CPU-only torch goes through ``torch.cuda._lazy_init`` (factories with a CUDA device
    call it from C++), so this also catches call sites whose error Megatron would swallow.
    """
    hits = []
    original = torch.cuda._lazy_init

    def record():
        frames = [f for f in traceback.extract_stack() if "megatron" in f.filename]
        hits.append(f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else "?")
        original()

    torch.cuda._lazy_init = record
    try:
        globals()[case](**kwargs)
    except Exception as err:
        raise AssertionError(f"{case} failed; CUDA call sites reached: {hits}") from err
    finally:
        torch.cuda._lazy_init = original
    return hits


def _attach_engine(ray_address: str, name: str | None):
    """This rank's rollout engine actor (connecting the rank to the test's Ray cluster), or None if it feeds none."""
    if name is None:
        return None
    import ray

    from mcore_rl.rollout.remote import NAMESPACE

    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=False, namespace=NAMESPACE)
    return ray.get_actor(name)


def _sync_steps_batch(bridge, groups):
    """The micro-batches (one row each, this DP rank's of four) and the LM loss the sync cases step on."""
    tokens = torch.randint(0, bridge.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))
    mine = tokens.chunk(parallel_state.get_data_parallel_world_size())[parallel_state.get_data_parallel_rank()]
    positions = torch.arange(mine.shape[1] - 1).expand(1, -1)
    microbatches = [{"input_ids": mb[:, :-1], "labels": mb[:, 1:], "position_ids": positions} for mb in mine.split(1)]

    def loss_fn(batch, output):
        loss = -token_logprobs(output, batch["labels"], bridge.vocab_size, groups.tp).mean()
        return loss, {"loss": loss.detach()}

    return microbatches, loss_fn


def train_and_sync(
    hf_dir: str,
    layout: dict,
    ray_address: str,
    engines: dict[int, str],
    steps: int,
    bucket_bytes: int,
    engine_dtype: str = "float32",
    engine_tp: int = 1,
    lora_rank: int = 0,
    sync_lora: str = "adapter",
    drafts: bool = False,
) -> list[dict]:
    """Alternate Adam steps and weight syncs into the named rollout engines (``engines``: owner rank -> name; the
        ``engine_tp`` ranks from the owner on feed it). ``lora_rank``: train LoRA adapters of that rank on the frozen
        model, synced as ``sync_lora`` says (alone, the engines serving them with vLLM's LoRA, or merged). ``drafts``: the
    engines draft with the model's MTP layers, which the sync sends too.

        Each engine sleeps while the trainer steps, as in the RL loop; before each sync it still holds the previous
        weights, which the probe must reject. The sync's reports (with that verdict) are returned per step, each
        with the verdict of a first sync that sent nothing (``unsent_verified``: the engines held the weights the
        trainer loaded, as a freshly started engine does).
    """
    import ray

    from mcore_rl.trainer.sync import ColocatedRoute, ProbeMismatchError, SyncConfig, WeightSync
    from models.lora import LoRAConfig, attach_lora

    rank = torch.distributed.get_rank()
    engine = _attach_engine(ray_address, engines.get(rank - rank % engine_tp))
    controller = engine if rank in engines else None  # one rank puts the engine to sleep and wakes it
    bridge, config, chunks, groups = _load(hf_dir, layout)
    lora = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank)
    if lora_rank:
        attach_lora(chunks, lora, seed=7, tp_group=groups.tp)
    optimizer = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True)
    step = MegatronTrainStep(chunks, config, optimizer, groups)
    route = ColocatedRoute(engine, next(chunks[0].parameters()).device, bucket_bytes, engine_tp)
    sync_config = SyncConfig(bucket_bytes=bucket_bytes, lora=sync_lora if lora_rank else "merged")
    sync = WeightSync(chunks, bridge, groups, route, step, sync_config, getattr(torch, engine_dtype), lora, drafts)
    microbatches, loss_fn = _sync_steps_batch(bridge, groups)
    reports = []
    try:
        try:
            sync.verify()  # nothing pushed yet: refused on every rank, before any collective
            verify_refused = False
        except RuntimeError as err:
            verify_refused = "nothing pushed" in str(err)
        sync.push(send=False)
        try:
            unsent_verified = sync.verify().bytes == 0
        except ProbeMismatchError:
            unsent_verified = False
        for _ in range(steps):
            if controller is not None:
                ray.get(controller.sleep.remote())
            assert step.step(microbatches, loss_fn).update_successful
            if controller is not None:
                ray.get(controller.wake_up.remote())  # only to let the probe score against the stale weights
            try:
                sync.probe()
                stale_rejected = False
            except ProbeMismatchError:
                stale_rejected = True
            if controller is not None:
                ray.get(controller.sleep.remote())  # the push wakes its weights only; verify the KV cache
            sync.push()
            kv_asleep_after_push = controller is not None and _refuses_to_generate(controller)
            report = sync.verify()
            reports.append(
                dict(
                    vars(report),
                    stale_rejected=stale_rejected,
                    kv_asleep_after_push=kv_asleep_after_push,
                    unpushed_verify_refused=verify_refused,
                    unsent_verified=unsent_verified,
                )
            )
    finally:
        sync.close()
    return reports


def train_sync_and_export(
    hf_dir: str, layout: dict, ray_address: str, engines: dict[int, str], steps: int, engine_tp: int, out_dir: str
) -> list[float]:
    """Adam steps, each followed by a weight sync into the named engines (probed, its tolerance lifted: the probe's
    max |Δ| per sync is returned), then the trained model exported as an HF checkpoint to ``out_dir`` (by rank 0):
    an engine started from it must hold what the synced engines hold."""
    import ray

    from converters.hf_io import StreamedShards, copy_model_files
    from mcore_rl.trainer.sync import ColocatedRoute, SyncConfig, WeightSync

    rank = torch.distributed.get_rank()
    engine = _attach_engine(ray_address, engines.get(rank - rank % engine_tp))
    bridge, config, chunks, groups = _load(hf_dir, layout)
    step = MegatronTrainStep(
        chunks, config, OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), groups
    )
    route = ColocatedRoute(engine, next(chunks[0].parameters()).device, 256 << 10, engine_tp)
    sync_config = SyncConfig(
        bucket_bytes=256 << 10, probe_max_tolerance=float("inf"), probe_mean_tolerance=float("inf")
    )
    sync = WeightSync(chunks, bridge, groups, route, step, sync_config, torch.float32)
    microbatches, loss_fn = _sync_steps_batch(bridge, groups)
    diffs = []
    try:
        for _ in range(steps):
            if rank in engines:
                ray.get(engine.sleep.remote())
            assert step.step(microbatches, loss_fn).update_successful
            sync.push()
            diffs.append(sync.verify().probe_max_abs_diff)
    finally:
        sync.close()
    writer = StreamedShards(out_dir, 1 << 30) if rank == 0 else None
    for name, tensor in export_hf(chunks, bridge, groups):
        if writer is not None:
            writer.write(name, tensor)
    if writer is not None:
        writer.close()
        copy_model_files(hf_dir, out_dir)
    return diffs


def _refuses_to_generate(engine) -> bool:
    import ray

    from mcore_rl.rollout.engine import SamplingConfig

    try:
        ray.get(engine.generate.remote([[1, 2]], SamplingConfig(max_new_tokens=1)))
    except ray.exceptions.RayTaskError as err:
        return "asleep" in str(err)
    return False


def _perturb(chunks, groups, seed: int, scale: float) -> None:
    """Add seeded noise to every parameter, drawn for the full tensor and sliced to this rank's shard, so the
    perturbed model is the same whatever the layout (replicated parameters stay identical across ranks)."""
    for lp in local_params(chunks):
        tp = torch.distributed.get_world_size(groups.expt_tp if lp.is_expert else groups.tp)
        tp_rank = torch.distributed.get_rank(groups.expt_tp if lp.is_expert else groups.tp)
        generator = torch.Generator().manual_seed(seed + zlib.crc32(lp.slot.encode()))
        full = torch.randn(full_shape(lp.param.shape, lp.tp_axis, tp), generator=generator)
        with torch.no_grad():
            lp.param.add_(shard(full, lp.tp_axis, tp_rank, tp) * scale * lp.param.std())


def perturb_and_sync(
    hf_dir: str, layout: dict, ray_address: str, engine_name: str, prompt_ids: list[int], new_tokens: int
) -> dict:
    """Megatron's greedy continuation before and after perturbing its weights, and the sync's report (rank 0
    feeds the engine)."""
    from mcore_rl.trainer.sync import ColocatedRoute, SyncConfig, WeightSync

    bridge, _, chunks, groups = _load(hf_dir, layout)
    model = MegatronModel(chunks, groups)
    engine = _attach_engine(ray_address, engine_name if torch.distributed.get_rank() == 0 else None)
    route = ColocatedRoute(engine, next(chunks[0].parameters()).device, 64 << 20)
    sync = WeightSync(chunks, bridge, groups, route, model, SyncConfig(bucket_bytes=64 << 20), torch.float32)
    before = _greedy(chunks, groups, bridge, prompt_ids, new_tokens)
    _perturb(chunks, groups, seed=7, scale=0.25)
    after = _greedy(chunks, groups, bridge, prompt_ids, new_tokens)
    try:
        report = sync.sync()
    finally:
        sync.close()
    return dict(before=before, after=after, report=vars(report))


def vocab_parallel_scores(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp: int, chunk_bytes: list[int]
) -> list[dict]:
    """Per dtype (fp32, bf16), loss weights (w_logp, w_entropy; an entropy weight of 0 detaches the entropy, as the
    policy loss does without a coefficient) and chunk size: log-probs, entropies and the full-vocabulary gradient of
    w_logp sum log p + w_entropy sum H from TP shards of ``logits`` (padded to 128 * tp with garbage), chunked and
    as the trainer computed them before (Megatron's ``vocab_parallel_cross_entropy``, the unchunked entropy)."""
    from mcore_rl.trainer.logprobs import token_scores
    from tests.lm_head_reference import unchunked_scores

    groups = init_parallel(ParallelConfig(tp=tp))
    padded = torch.nn.functional.pad(logits, (0, -logits.shape[-1] % (128 * tp)), value=123.0)
    rank, results = torch.distributed.get_rank(groups.tp), []
    for dtype in (torch.float32, torch.bfloat16):
        shard = padded.chunk(tp, dim=-1)[rank].to(dtype)
        for weights in ((1.0, 0.0), (0.7, -3.0)):  # |w_entropy| > 1: (z - sum p z) w overflows at padding

            def backward(logp, entropy, weights=weights):
                entropy = entropy if weights[1] else entropy.detach()
                (weights[0] * logp.sum() + weights[1] * entropy.sum()).backward()

            local = shard.clone().requires_grad_(True)
            before = unchunked_scores(local, targets, vocab_size, groups.tp, entropy_grad=bool(weights[1]))
            backward(*before)
            runs = {"before": (*(t.detach() for t in before), _full_vocab(local.grad.float(), groups, vocab_size))}
            for size in chunk_bytes:
                local = shard.clone().requires_grad_(True)
                with torch.no_grad():
                    scored = token_scores(local, targets, vocab_size, groups.tp, chunk_bytes=size)
                scores = token_scores(local, targets, vocab_size, groups.tp, chunk_bytes=size)
                backward(*scores)
                assert local.grad.dtype == dtype and torch.isfinite(local.grad).all()  # padding's too
                assert torch.equal(local.detach(), shard)  # the model's output is not written to
                grad = _full_vocab(local.grad.float(), groups, vocab_size)
                runs[size] = (*(t.detach() for t in scores), grad, *scored)
            results.append({"dtype": str(dtype), "weights": weights, "runs": runs})
    return results


def _routing(hf_dir: str, tokens: torch.Tensor, how: str) -> torch.Tensor:
    """Expert ids [b, s-1, layers, top-k] for the input positions of ``tokens``, as a rollout engine returns them:
    HF transformers' own top-k ("hf"), or distinct random experts per token ("random")."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    k, experts, layers = hf.config.num_experts_per_tok, hf.config.num_experts, hf.config.num_hidden_layers
    inputs = tokens[:, :-1]
    if how == "random":
        scores = torch.rand(*inputs.shape, layers, experts, generator=torch.Generator().manual_seed(9))
        return scores.argsort(-1)[..., :k].to(torch.int16)
    with torch.no_grad():
        logits = hf(inputs, output_router_logits=True).router_logits  # per layer: [b*s, experts]
    ids = [layer.view(*inputs.shape, experts).topk(k, dim=-1).indices for layer in logits]
    return torch.stack(ids, dim=2).to(torch.int16)


def _episode_batch() -> dict:
    """Eight responses of different lengths after 4-token prompts, with their advantages: a GRPO episode's batch."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 9, 7, 12, 10, 8, 11, 6])
    tokens = torch.randint(4, 100, (8, 12), generator=generator)
    tokens[torch.arange(12)[None] >= lengths[:, None]] = 0
    positions = torch.arange(11)[None]
    mask = ((positions >= 4) & (positions < lengths[:, None] - 1)).float()
    return {"tokens": tokens, "lengths": lengths, "mask": mask, "advantages": torch.randn(8, generator=generator)}


def policy_resume(hf_dir: str, layout: dict, checkpoint_dir: str, save: str | None = None) -> dict:
    """Three GRPO steps of the policy trainer at ``layout`` with a checkpoint after the second (``save``: as
    ``per_rank`` or ``reshardable`` saves write it, or ``legacy``: gathered without the record of its layouts, as
    mcore-rl wrote them before); or, ``save`` None, the checkpoint loaded instead of the first two. The third
    step's metrics and the Adam digest after it (its step count: 3, where each parameter's Adam step resumed)."""
    trainer, batch = _policy_trainer(hf_dir, layout, 4, lr=1e-2), _episode_batch()
    batch["old_logp"] = batch["rollout_logp"] = trainer.logprobs(batch, micro_batch_size=2) * batch["mask"]
    if save is None:
        trainer.load(checkpoint_dir)
    else:
        for _ in range(2):
            trainer.train(batch, global_batch_size=8, micro_batch_size=2)
        trainer.save(checkpoint_dir, reshardable=save != "per_rank")
        torch.distributed.barrier()
        if save == "legacy" and torch.distributed.get_rank() == 0:  # the record of its layouts taken out
            common = os.path.join(checkpoint_dir, trainer.checkpoint_dir, "common.pt")
            state = torch.load(common, weights_only=False)
            del state["content_metadata"]
            torch.save(state, common)
        torch.distributed.barrier()
    step = trainer.train(batch, global_batch_size=8, micro_batch_size=2)[0]
    return dict(step=step, digest=trainer.optimizer_digest())


def policy_trainer_segments(hf_dir: str, layout: dict) -> dict:
    """One packed episode of eight samples that became ten rows (multi-turn trajectories whose template rewrote
    the history, ``owner`` their sample), as the driver runs it: the old log-probs of the rows after the first step
    (five, over the data-parallel ranks), then two steps of four samples each (five rows each); returns every row's
    log-probs at its response positions before the steps and each step's metrics."""
    from mcore_rl.batch import step_starts

    trainer = _policy_trainer(hf_dir, layout, 2, max_token_in_packing=24)
    batch = {k: torch.cat([v, v[[1, 5]]]) for k, v in _episode_batch().items()}
    batch["owner"] = torch.tensor([0, 0, 1, 2, 3, 4, 4, 5, 6, 7])
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.25, -0.75, 0.5, -1.0, 0.0, 2.0])[batch["owner"]]
    batch["rollout_logp"] = logprobs = trainer.logprobs(batch, micro_batch_size=2) * batch["mask"]
    first = step_starts(batch, 4)[1]
    trainer.score_old({k: v[first:] for k, v in batch.items()}, 2, fetch=False)
    return {"logprobs": logprobs, "steps": trainer.train(batch, global_batch_size=4, micro_batch_size=2)}


def policy_trainer_episodes(
    hf_dir: str,
    layout: dict,
    offload: bool = False,
    max_token_in_packing: int = 0,
    moe: dict | None = None,
    routing: str | None = None,
    recompute: str = "none",
    mtp_loss_coef: float = 0.0,
) -> dict:
    """Two GRPO episodes of the policy-trainer role (responses of different lengths), its device memory freed and
    restored between them when ``offload``; returns each episode's old log-probs, each optimizer step's metrics
    and the bytes the offload freed. ``routing``: the batch carries routed experts to replay (see ``_routing``);
    ``mtp_loss_coef``: the MTP layers train too."""
    from mcore_rl.trainer.moe import MoEConfig
    from mcore_rl.trainer.offload import StorageOffloader

    trainer = _policy_trainer(
        hf_dir, layout, 4, max_token_in_packing=max_token_in_packing, moe=MoEConfig(**(moe or {})),
        recompute=recompute, mtp_loss_coef=mtp_loss_coef,
    )  # fmt: skip
    batch = _episode_batch()
    if routing:
        batch["routed_experts"] = _routing(hf_dir, batch["tokens"], routing)
    logprobs, steps, freed = [], [], 0
    for _ in range(2):
        batch["old_logp"] = batch["rollout_logp"] = trainer.logprobs(batch, micro_batch_size=2) * batch["mask"]
        logprobs.append(batch["old_logp"])
        steps += trainer.train(batch, global_batch_size=4, micro_batch_size=2)
        if offload:
            # on CPU the role itself never offloads
            offloaders = [StorageOffloader(*trainer._offloadable(part)) for part in trainer.offload_parts]
            freed = sum(offloader.offload() for offloader in offloaders)
            for offloader in offloaders:
                offloader.onload()
    return dict(logprobs=logprobs, steps=steps, freed=freed)


def _expert_biases(chunks, groups) -> dict[int, list[float]]:
    """Every MoE layer's expert bias (by layer number), from all pipeline stages, on every rank."""
    from mcore_rl.trainer.moe import routers
    from parallel.comm import all_gather_objects

    local = {n: r.expert_bias.tolist() for n, r in routers(chunks).items() if r.expert_bias is not None}
    return {n: b for stage in all_gather_objects(local, groups.pp) for n, b in stage.items()}


def moe_balancing_step(hf_dir: str, layout: dict, moe: dict, checkpoint_dir: str) -> dict:
    """One GRPO step of the policy-trainer role with the load-balancing settings ``moe``; its router metrics; the
    expert biases after the step, and as a fresh trainer loads them back from the step's checkpoint."""
    from mcore_rl.trainer.moe import MoEConfig

    def trainer():
        return _policy_trainer(hf_dir, layout, 4, moe=MoEConfig(**moe))

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 100, (8, 13), generator=generator)
    mask = torch.zeros(8, 12)  # 12 positions: no padding for TP=2
    mask[:, 5:] = 1
    batch = {"tokens": tokens, "mask": mask, "advantages": torch.randn(8, generator=generator)}
    first = trainer()
    initial = _expert_biases(first.chunks, first.groups)
    batch["old_logp"] = batch["rollout_logp"] = first.logprobs(batch, micro_batch_size=2) * mask
    step = first.train(batch, global_batch_size=8, micro_batch_size=2)[0]
    result = dict(step=step, router=first.router_metrics(), initial=initial)
    result["trained"] = _expert_biases(first.chunks, first.groups)
    if torch.distributed.get_rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
    torch.distributed.barrier()
    first.save(checkpoint_dir)
    second = trainer()
    second.load(checkpoint_dir)
    result["loaded"] = _expert_biases(second.chunks, second.groups)
    return result


def trained_checkpoint(hf_dir: str, layout: dict, checkpoint_dir: str, reference_file: str) -> None:
    """One GRPO step of the policy trainer at ``layout``, then its checkpoint (model, optimizer, schedule) saved as
    in training and its weights exported to ``reference_file`` (safetensors), the expected conversion."""
    from safetensors.torch import save_file

    trainer = _policy_trainer(hf_dir, layout, 4, lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 100, (8, 13), generator=generator)
    mask = torch.ones(8, 12)
    batch = {"tokens": tokens, "mask": mask, "advantages": torch.randn(8, generator=generator)}
    batch["old_logp"] = batch["rollout_logp"] = trainer.logprobs(batch, micro_batch_size=2) * mask
    trainer.train(batch, global_batch_size=8, micro_batch_size=2)
    exported = {name: t.clone() for name, t in export_hf(trainer.chunks, trainer.bridge, trainer.groups)}
    if torch.distributed.get_rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        save_file(exported, reference_file)
    torch.distributed.barrier()
    trainer.save(checkpoint_dir)


def packed_vs_padded_scores(hf_dir: str, layout: dict, tokens: torch.Tensor, lengths: list[int]):
    """Log-probs of rows of different ``lengths`` scored in padded micro-batches and in THD packs (this rank's
    share of the rows, as a role scores them), each masked to the rows' real positions."""
    bridge, _, chunks, groups = _load(hf_dir, layout)
    model = MegatronModel(chunks, groups)
    mask = torch.arange(tokens.shape[1] - 1)[None] < torch.tensor(lengths)[:, None] - 1
    padded = model.logprobs(tokens, bridge.vocab_size, micro_batch_size=2)
    packed = model.logprobs(tokens, bridge.vocab_size, 2, lengths=lengths, max_tokens=32)
    return padded * mask, packed * mask


def policy_trainer_first_step(
    hf_dir: str,
    layout: dict,
    batch: dict,
    loss: dict,
    params_dtype: str,
    micro_batch_size: int = 2,
    share_prompts: bool = False,
    max_token_in_packing: int = 0,
) -> dict:
    """The policy-trainer role's old log-probs of ``batch`` ([N, L-1], every rank) and the metrics of one
    optimizer step over the whole batch (computed at the weights the log-probs were scored with)."""
    from mcore_rl.algorithms.grpo import PolicyLossConfig

    trainer = _policy_trainer(
        hf_dir, layout, 1, overrides={"params_dtype": getattr(torch, params_dtype)},
        algorithm=PolicyLossConfig(**loss), share_prompts=share_prompts, max_token_in_packing=max_token_in_packing,
    )  # fmt: skip
    logprobs = trainer.logprobs(batch, micro_batch_size)
    (step,) = trainer.train(batch, global_batch_size=batch["tokens"].shape[0], micro_batch_size=micro_batch_size)
    return dict(logprobs=logprobs, step=step)


def policy_trainer_steps(
    hf_dir: str, layout: dict, batch: dict, share_prompts: bool, global_batch_size: int, micro_batch_size: int
) -> dict:
    """The policy-trainer role's log-probs of ``batch`` and its optimizer steps over it, as the driver runs them:
    old log-probs scored and kept on the ranks only for the rows after the first step (whose are its own)."""

    trainer = _policy_trainer(hf_dir, layout, 2, share_prompts=share_prompts)
    logprobs = trainer.logprobs(batch, micro_batch_size)
    later = {k: v[global_batch_size:] for k, v in batch.items()}
    assert trainer.score_old(later, micro_batch_size, fetch=False) is None  # kept here, not returned
    kept = trainer._old_logp
    steps = trainer.train(batch, global_batch_size, micro_batch_size)
    assert trainer._old_logp is None  # taken by the steps
    kept_diff = (kept - logprobs[global_batch_size:]).abs().max().item()  # other micro-batches: float order
    return dict(logprobs=logprobs * batch["mask"], steps=steps, kept_diff=kept_diff)


def fails_on_rank(rank: int) -> None:
    """Raises on ``rank`` alone, after its peers' last collective: they answer, the pool rejoins them."""
    if torch.distributed.get_rank() == rank:
        raise ValueError(f"rank {rank} fails on purpose")


def default_group_sum() -> float:
    ones = torch.ones(1)
    torch.distributed.all_reduce(ones)
    return ones.item()


def layout_changes_release_threads(hf_dir: str, layouts: list[dict], tokens: torch.Tensor) -> dict:
    """This rank's threads by name before ``layouts``, their highest total while each layout's model took a training
    step (its groups alive), and by name after the last layout was torn down."""
    import collections

    from parallel.groups import destroy_parallel

    def threads() -> collections.Counter:
        tasks = os.listdir("/proc/self/task")
        return collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)

    destroy_parallel()
    baseline, peak = threads(), 0
    for layout in layouts:
        train_step(hf_dir, layout, tokens, micro_batch_size=2)
        peak = max(peak, threads().total())
        destroy_parallel()
    return dict(baseline=baseline, peak=peak, after=threads())


def load_into_te_like_attention(checkpoint_dir: str, hf_dir: str, layout: dict) -> int:
    """A converted checkpoint (local layout) loaded into a model whose core attention checkpoints an
    ``_extra_state``, as TransformerEngine's does; exports the weights and asserts them equal to ``hf_dir``'s.
    Returns how many ``_extra_state`` objects the model requested that the checkpoint lacked."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from converters.torch_dist import Reader, find_megatron, load_model
    from models.attention import SDPAttention

    class WithExtraState(SDPAttention):  # TransformerEngine's modules keep FP8 metadata this way
        def get_extra_state(self):
            return torch.zeros(0)

        def set_extra_state(self, state) -> None:
            assert state is None or torch.is_tensor(state), state

    parallel = ParallelConfig(**layout)
    groups = init_parallel(parallel)
    bridge = get_bridge(hf_dir)
    chunks = bridge.build_model(bridge.transformer_config(parallel))
    for module in chunks[0].modules():
        if type(module) is SDPAttention:
            module.__class__ = WithExtraState
    checkpoint_dir = find_megatron(checkpoint_dir)
    stored = set(Reader(checkpoint_dir).metadata.state_dict_metadata)
    state = chunks[0].sharded_state_dict()
    absent = [
        k
        for k, v in state.items()
        if isinstance(v, ShardedObject) and "core_attention" in k and v.unique_key not in stored
    ]
    load_model(chunks, checkpoint_dir)
    ckpt = HFCheckpoint(hf_dir)
    for name, tensor in export_hf(chunks, bridge, groups):
        assert torch.equal(tensor, ckpt.get(name)), name
    return len(absent)


def optimizer_with_megatrons_gloo_groups(hf_dir: str) -> str:
    """What megatron-core 0.16.1 says to the arguments the trainer passed on CUDA before (its own gloo groups
    beside explicit ones)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    _, config, chunks, groups = _load(hf_dir, {})
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = [DistributedDataParallel(config, ddp, chunk) for chunk in chunks]
    optimizer = OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True)
    try:
        get_megatron_optimizer(optimizer, model, use_gloo_process_groups=True, pg_collection=groups)
    except ValueError as err:
        return str(err)
    return ""


def _critic_batch(seed: int = 0) -> dict:
    """Eight rows of different lengths (4-token prompts), returns to regress on."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 9, 7, 12, 10, 8, 11, 6])
    tokens = torch.randint(4, 100, (8, 12), generator=generator)
    tokens[torch.arange(12)[None] >= lengths[:, None]] = 0
    positions = torch.arange(11)[None]
    mask = ((positions >= 4) & (positions < lengths[:, None] - 1)).float()
    returns = torch.randn(8, 11, generator=generator) * mask
    prompt_lengths = torch.full((8,), 4)
    return {"tokens": tokens, "lengths": lengths, "prompt_lengths": prompt_lengths, "mask": mask, "returns": returns}


def critic_episodes(
    hf_dir: str,
    layout: dict,
    max_token_in_packing: int = 0,
    share_prompts: bool = False,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    episodes: int = 2,
    fused_adam: bool = True,
) -> dict:
    """``episodes`` PPO critic episodes (values scored, then two optimizer steps towards fixed returns) of the
    critic role; each episode's values and each step's metrics, the Adam digest, and whether every Adam group runs
    torch's fused kernel. ``checkpoint_dir``: saved there after the first episode; ``resume``: instead loaded from
    there before the (remaining) episodes run. ``fused_adam=False``: Adam as Megatron-Core builds it (torch's
    per-tensor loop on CPU)."""
    from mcore_rl.config.schema import OptimizerSettings

    optimizer = OptimizerSettings(lr=1e-3, lr_decay_style="cosine", min_lr=1e-4, lr_warmup_steps=1)
    critic = _critic(
        hf_dir, layout, 4, optimizer, max_token_in_packing=max_token_in_packing, share_prompts=share_prompts,
        value_clip=0.2,
    )  # fmt: skip
    groups = [g for opt in critic._optimizers() for g in opt.optimizer.param_groups]
    for group in groups if not fused_adam else []:
        group["fused"] = None
    batch = _critic_batch()
    if resume:
        critic.load(checkpoint_dir)
    values, steps = [], []
    for episode in range(episodes):
        batch["values"] = critic.values(batch, micro_batch_size=2) * batch["mask"]
        values.append(batch["values"])
        steps += critic.train(batch, global_batch_size=4, micro_batch_size=2)
        if checkpoint_dir and not resume and episode == 0:
            critic.save(checkpoint_dir, reshardable=True)  # the test resumes it under another layout
    fused = all(group["fused"] for group in groups)
    return dict(values=values, steps=steps, digest=critic.optimizer_digest(), fused=fused)


def critic_values(hf_dir: str, layout: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The critic role's values [N, L-1] of ``tokens`` (every rank)."""

    critic = _critic(hf_dir, layout, 1)
    lengths = torch.full((tokens.shape[0],), tokens.shape[1])
    return critic.values({"tokens": tokens, "lengths": lengths}, micro_batch_size=2)


def reward_model_scores(hf_dir: str, layout: dict, tokens: torch.Tensor, lengths: torch.Tensor, packing: int = 0):
    """A reward model's score of each row (its first ``lengths`` tokens), scored by the reward-model role."""
    from mcore_rl.config.schema import RewardModelConfig
    from mcore_rl.trainer.value import ValueModel

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    section = RewardModelConfig(load=hf_dir, parallel=ParallelConfig(**layout), max_token_in_packing=packing)
    role = ValueModel(rank, world, ("127.0.0.1", 0), section, 1)
    return role.sequence_scores({"tokens": tokens, "lengths": lengths}, micro_batch_size=2)


def _full(tensor: torch.Tensor, axis: int | None, group) -> torch.Tensor:
    """The whole of a TP-split ``tensor`` (split on ``axis``; None: replicated)."""
    if axis is None:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(group.size())]
    torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
    return torch.cat(shards, dim=axis)


def _b_from_weights(adapters, rank: int, factor: float = 1.0) -> None:
    """Each adapter's B set to ``factor`` times its base weight's first ``rank`` columns (its rows as the layout lays
    them out): adapters that act, alike in every layout."""
    for adapter in adapters:
        weight = adapter.base_weight.detach()
        weight = _full(weight, 1, adapter.tp_group) if adapter.split == "a" else weight  # a row-parallel W's columns
        with torch.no_grad():
            adapter.b.copy_(weight[:, :rank] * factor)


def lora_sgd_step(
    hf_dir: str,
    layout: dict,
    tokens: torch.Tensor,
    rank: int,
    targets: list[str],
    grouped: bool = True,
    dropout: float = 0.0,
    train_router: bool = False,
) -> dict:
    """One SGD step (lr 1, no clipping) of LoRA adapters on a frozen model, B set to the base weight's first columns:
    the loss, the log-probs of ``tokens`` with the adapters and without them (the base model), each adapter's whole
    gradient (A's and B's, from the update) and how far each merged shard is from ``W + scale B A`` computed whole;
    on every rank, all pipeline stages merged. ``grouped``: an MoE model's experts as grouped GEMMs, or Megatron's
    sequential experts. ``dropout``: the adapters' (then also whether the TP ranks drew the same masks for the
    inputs they all hold whole, after the step). ``train_router``: the routers train too (then also their
    gradients, and the base model's log-probs after the step, which must not have moved)."""
    from models.lora import LoRAConfig, adapters, adapters_off, attach_lora, merged, router_copies
    from parallel.comm import all_gather_objects

    bridge, config, chunks, groups = _load(hf_dir, layout, **({} if grouped else {"moe_grouped_gemm": False}))
    if grouped:
        _grouped_kernel(chunks)  # its own LoRA path (models.experts._with_lora)
    lora = LoRAConfig(rank=rank, alpha=2.0 * rank, targets=targets, dropout=dropout, train_router=train_router)
    attach_lora(chunks, lora, seed=7, tp_group=groups.tp)
    routers = {slot: copy._router[0].weight for slot, copy in router_copies(chunks).items()}
    routers_before = {slot: weight.detach().clone() for slot, weight in routers.items()}
    mine = adapters(chunks)  # a routed expert's over expert-TP (its adapter's tp_group), the others over TP
    _b_from_weights(mine.values(), rank)
    read = merged(chunks)
    merge_error = 0.0
    for adapter in mine.values():  # the merge against W + scale B A from whole tensors
        axis, group = adapter.axis(adapter.split) if adapter.split else None, adapter.tp_group  # W's split
        whole_w = _full(adapter.base_weight.detach(), axis, group)
        whole_a, whole_b = (_full(getattr(adapter, f).detach(), adapter.axis(f), group) for f in ("a", "b"))
        want = whole_w + lora.scale * whole_b @ whole_a
        want = want if axis is None else shard(want, axis, group.rank(), group.size())
        merge_error = max(merge_error, (read(adapter.base_weight) - want).abs().max().item())
    before = {slot: (a.a.detach().clone(), a.b.detach().clone()) for slot, a in mine.items()}
    optimizer = OptimizerConfig(optimizer="sgd", lr=1.0, clip_grad=0.0, use_distributed_optimizer=False)
    step = MegatronTrainStep(chunks, config, optimizer, groups)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    mine_tokens = tokens.chunk(dp)[dp_rank]
    positions = torch.arange(mine_tokens.shape[1] - 1).expand(1, -1)
    microbatches = [
        {"input_ids": mb[:, :-1], "labels": mb[:, 1:], "position_ids": positions} for mb in mine_tokens.split(1)
    ]

    def loss_fn(batch, output):
        loss = -token_logprobs(output, batch["labels"], bridge.vocab_size, groups.tp).mean()
        return loss, {"loss": loss.detach()}

    with adapters_off(chunks):
        base_logp = step.logprobs(tokens, bridge.vocab_size, 2)
    lora_logp = step.logprobs(tokens, bridge.vocab_size, 2)
    result = step.step(microbatches, loss_fn)
    grads, table = {}, MappingTable(bridge.mappings())
    for slot, adapter in mine.items():  # SGD at lr 1: the gradient is what the step took away
        a_old, b_old, group = *before[slot], adapter.tp_group
        grad_a = _full(a_old - adapter.a.detach(), adapter.axis("a"), group)
        grad_b = _full(b_old - adapter.b.detach(), adapter.axis("b"), group)
        if adapter.column:  # B's rows are laid out as W's (gate/up per TP rank): compared in HF's order
            mapping, _ = table.resolve(f"{slot}.weight")
            grad_b = torch.cat(mapping.to_hf(grad_b, group.size()))
        grads[slot] = (grad_a, grad_b)
    grads |= {slot: (routers_before[slot] - weight.detach(),) for slot, weight in routers.items()}  # replicated
    merged_grads = {}  # every stage's, every EP rank's experts
    for part in all_gather_objects(grads, torch.distributed.group.WORLD):
        merged_grads |= part
    masks_agree = True
    for adapter in (a for a in mine.values() if a.column and not a.expert):  # in training mode, as after a step
        masks = all_gather_objects(adapter._drop(torch.ones(3, adapter.a.shape[1])), adapter.tp_group)
        masks_agree &= all(torch.equal(m, masks[0]) for m in masks)
    errors = all_gather_objects(merge_error, torch.distributed.group.WORLD)
    with adapters_off(chunks):
        base_after = step.logprobs(tokens, bridge.vocab_size, 2)
    return {
        "loss": result.loss,
        "base_logp": base_logp,
        "base_after": base_after,
        "lora_logp": lora_logp,
        "grads": merged_grads,
        "merge_error": max(errors),
        "trained": sorted(n for c in step.model for n, p in c.named_parameters() if p.requires_grad),
        "masks_agree": masks_agree,
    }


def lora_checkpoint_export(
    hf_dir: str, layout: dict, directory: str, load: bool, targets: list[str] | None = None, train_router: bool = False
) -> dict[str, torch.Tensor]:
    """Adapters (rank 4, on ``targets``; default LoRA's) on the model under ``layout``: with B from the base
    weights, saved to ``directory`` (``load`` False), or loaded from it; the merged HF tensors exported either way.
    ``train_router``: the routers' weights trained too (moved by 0.01 before the save), their copies as loaded
    returned beside the export (``lora.<router>.weight``)."""
    from megatron.core import dist_checkpointing

    from converters.torch_dist import load_model, model_state
    from models.lora import LoRAConfig, adapters, attach_lora, merged, router_copies
    from parallel.comm import all_gather_objects

    bridge, _, chunks, groups = _load(hf_dir, layout)
    lora = LoRAConfig(rank=4, alpha=8.0, train_router=train_router, **({"targets": targets} if targets else {}))
    attach_lora(chunks, lora, 7, groups.tp)
    copies = router_copies(chunks)
    if load:
        for copy in copies.values():  # taken from the model as built: the checkpoint's must replace them
            copy.loaded_weight.zero_()
        load_model(chunks, directory)
    else:
        _b_from_weights(adapters(chunks).values(), 4)
        for copy in copies.values():
            with torch.no_grad():
                copy._router[0].weight.add_(0.01)
        dist_checkpointing.save(model_state(chunks), directory)
    out = {name: t.clone() for name, t in export_hf(chunks, bridge, groups, read=merged(chunks))}
    for part in all_gather_objects({f"lora.{s}.weight": c.loaded_weight.clone() for s, c in copies.items()}, groups.pp):
        out |= part  # every stage's
    return out


def lora_checkpoint_logprobs(hf_dir: str, layout: dict, directory: str, tokens: torch.Tensor):
    """A LoRA policy's checkpoint as a run saves it (its torch_dist files and lora.json; rank 8, alpha 16, B from
    the base weights) in ``directory``, and the trainer's log-probs of ``tokens`` with the adapters on and off."""
    import json
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from converters.torch_dist import LORA_FILE, model_state
    from models.lora import LoRAConfig, adapters, adapters_off, attach_lora

    bridge, _, chunks, groups = _load(hf_dir, layout)
    attach_lora(chunks, LoRAConfig(rank=8, alpha=16.0), seed=7, tp_group=groups.tp)
    _b_from_weights(adapters(chunks).values(), 8, 0.05)
    dist_checkpointing.save(model_state(chunks), directory)
    if torch.distributed.get_rank() == 0:
        (Path(directory) / LORA_FILE).write_text(json.dumps({"rank": 8, "alpha": 16.0}))
    model = MegatronModel(chunks, groups)
    with adapters_off(chunks):
        base = model.logprobs(tokens, bridge.vocab_size, micro_batch_size=2)
    return model.logprobs(tokens, bridge.vocab_size, micro_batch_size=2), base


def lora_logprobs_from(hf_dir: str, layout: dict, directory: str, tokens: torch.Tensor) -> torch.Tensor:
    """As a LoRA run starts from ``directory``: adapters (rank 8, alpha 16) attached, then the weights loaded (the
    adapters too, where it holds them); the log-probs of ``tokens``."""
    from models.lora import LoRAConfig, attach_lora

    parallel = ParallelConfig(**layout)
    groups = init_parallel(parallel)
    bridge = get_bridge(hf_dir)
    chunks = bridge.build_model(bridge.transformer_config(parallel, **INIT_SKIPPED))
    attach_lora(chunks, LoRAConfig(rank=8, alpha=16.0), seed=3, tp_group=groups.tp)
    load_weights(chunks, bridge, directory, groups)
    return MegatronModel(chunks, groups).logprobs(tokens, bridge.vocab_size, micro_batch_size=2)


def load_plain(hf_dir: str, layout: dict, directory: str) -> None:
    """The model without adapters loaded from the Megatron checkpoint ``directory``."""
    bridge, _, chunks, groups = _load(hf_dir, layout)
    load_weights(chunks, bridge, directory, groups)


def mtp_scores(hf_dir: str, layout: dict, tokens: torch.Tensor, lengths: list[int], packing: int = 0):
    """With the MTP block running under ``layout``: its depth-1 log-probs of ``tokens`` (log p(token i + 2) at
    position i) and the model's own log-probs; and the model's log-probs with the block off. Padded micro-batches,
    or THD packs of ``packing`` tokens."""
    from mcore_rl.algorithms.mtp import mtp_logprobs
    from models.mtp import mtp_active

    bridge, _, chunks, groups = _load(hf_dir, layout)
    model, vocab = MegatronModel(chunks, groups), bridge.vocab_size
    args = dict(micro_batch_size=2, lengths=lengths, max_tokens=packing)
    with mtp_active(chunks):
        mtp = model.score(tokens, lambda b, out: mtp_logprobs(b, out.depths, vocab, groups.tp, groups.cp)[0], **args)
        main = model.score(tokens, lambda b, out: token_logprobs(out.logits, b["labels"], vocab, groups.tp), **args)
    return mtp, main, model.score(tokens, lambda b, out: token_logprobs(out, b["labels"], vocab, groups.tp), **args)


def lora_router_policy(hf_dir: str, layout: dict, directory: str, moe: dict) -> dict:
    """A LoRA policy-trainer role that trains its routers (``train_router``): its reference's (adapters off) and its
    own log-probs of an episode's batch before and after an optimizer step, and the routers' largest move; then
    saved to ``directory`` and resumed from it by a trainer started from ``hf_dir`` as a run's: that one's log-probs
    both ways, and the LoRA settings the checkpoint records. ``moe``: the trainer's MoE settings."""
    import json
    from pathlib import Path

    from mcore_rl.trainer.moe import MoEConfig
    from models.lora import LoRAConfig, router_copies

    lora = LoRAConfig(rank=4, targets=["linear_proj"], train_router=True)
    make = lambda: _policy_trainer(hf_dir, layout, 4, lr=1e-2, lora=lora, moe=MoEConfig(**moe))  # noqa: E731
    trainer, batch = make(), _episode_batch()
    both = lambda t: (t.base_logprobs(batch, 2) * batch["mask"], t.logprobs(batch, 2) * batch["mask"])  # noqa: E731
    before = both(trainer)
    routers = [copy._router[0].weight for copy in router_copies(trainer.chunks).values()]
    loaded = [weight.detach().clone() for weight in routers]
    batch["old_logp"] = batch["rollout_logp"] = before[1]
    trainer.train(batch, global_batch_size=8, micro_batch_size=2)
    moved = max((weight.detach() - copy).abs().max().item() for weight, copy in zip(routers, loaded, strict=True))
    after = both(trainer)
    trainer.save(directory)
    resumed = make()
    resumed.load(directory)
    settings = json.loads((Path(directory) / trainer.checkpoint_dir / "lora.json").read_text())
    return dict(before=before, after=after, resumed=both(resumed), moved=moved, settings=settings)


def sockets_opened_by_a_layout(layout: dict) -> dict:
    """The sockets this rank opens building ``layout``'s groups as roles build them
    (:func:`parallel.groups.gloo_connects_on_first_use`), then at a collective over the tensor-parallel group (its
    result: the sum of the ranks' ones), and building them eagerly (:func:`parallel.transfer.connecting_now`).
    Sockets are told apart by their inodes, each count taken once the set holds still for a second: what counts is
    the sockets a step opens, not the net change, as a freed group's connections close meanwhile."""
    import time

    from parallel.groups import destroy_parallel
    from parallel.transfer import connecting_now

    def sockets() -> set[str]:
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:  # the listing's own descriptor, closed since
                continue
            if link.startswith("socket:"):
                found.add(link)
        return found

    def settled() -> set[str]:  # unchanged for a second: a loaded host may still be making connections after 0.1 s
        last, still = sockets(), 0
        for _ in range(300):
            time.sleep(0.1)
            now = sockets()
            still = still + 1 if now == last else 0
            if still == 10:
                return now
            last = now
        return last

    destroy_parallel()
    before = settled()
    groups = init_parallel(ParallelConfig(**layout))
    after = settled()
    opened = dict(lazy=len(after - before))
    total = torch.ones(1)
    torch.distributed.all_reduce(total, group=groups.tp)
    before, after = after, settled()
    opened |= dict(collective=len(after - before), total=total.item())
    destroy_parallel()
    before = settled()
    with connecting_now():
        init_parallel(ParallelConfig(**layout))
    return opened | dict(eager=len(settled() - before))


def shm_collectives_match_gloo(directory: str, private: bool) -> dict:
    """Megatron's bucket collectives through shared windows against gloo's, on the whole world, on pairs and on each
    rank alone: a bucket reduce-scattered into its own shard (a view of it, as Megatron's grads; summed, or averaged
    as with ``average_in_collective``) and all-gathered from it (as its params), fp32 and bf16, the windows growing
    with a larger bucket; and the group sizes torch's collectives were called for. ``directory``: where the windows
    are made (its own, so no other process's windows are counted as left); ``private``: a subdirectory per rank,
    where no rank can map its peers' windows, and torch's collectives serve."""
    from pathlib import Path

    import torch.distributed as dist

    from parallel.shm import SharedMemoryCollectives

    rank = dist.get_rank()
    where = Path(directory) / str(rank) if private else Path(directory)
    where.mkdir(parents=True, exist_ok=True)
    fallbacks = set()

    def counted(collective):
        def call(output, input, *args, group, **kwargs):
            fallbacks.add(group.size())
            return collective(output, input, *args, group=group, **kwargs)

        return call

    shm = SharedMemoryCollectives(counted(dist.reduce_scatter_tensor), counted(dist.all_gather_into_tensor), where)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    results = {}
    for name, group in (("world", dist.group.WORLD), ("pair", pairs[rank // 2]), ("one", alone[rank])):
        size, grank = group.size(), group.rank()
        cases = [(op, dtype, count) for op in ("SUM", "AVG")
                 for dtype, count in ((torch.float32, 1000), (torch.bfloat16, 24), (torch.float32, 4096))]  # fmt: skip
        for op, dtype, count in cases:
            generator = torch.Generator().manual_seed(rank * 7 + count)
            bucket = torch.randn(count * size, generator=generator).to(dtype)
            expected = torch.empty(count, dtype=dtype)
            reduce_op = getattr(dist.ReduceOp, op)
            dist.reduce_scatter_tensor(expected, bucket.clone(), op=reduce_op, group=group)
            shard = bucket[grank * count : (grank + 1) * count]
            shm.reduce_scatter_tensor(shard, bucket, op=reduce_op, group=group)
            reduced = shard.clone()
            gathered = torch.empty(count * size, dtype=dtype)
            dist.all_gather_into_tensor(gathered, reduced, group=group)
            shm.all_gather_into_tensor(bucket, shard, group=group)
            results[f"{name}/{op}/{dtype}/{count}"] = {
                "reduce_scatter": ((reduced - expected).abs().max() / expected.abs().max()).item(),  # relative
                "exact": torch.equal(reduced, expected),
                "all_gather": torch.equal(bucket, gathered),
            }
    windows = shm._windows.get(dist.group.WORLD)
    results["shared"] = {"world": windows is not None}
    results["window_bytes"] = windows[rank].numel() if windows else 0
    dist.barrier()  # every rank has unlinked its windows
    left = list(Path(directory).glob(f"**/mcore_rl_shm_{os.getuid()}_*"))
    results["files_left"] = [str(p) for p in left]
    results["fallback_sizes"] = sorted(fallbacks)
    for group in pairs + alone:
        dist.destroy_process_group(group)
    return results


def rows_in_shares(count: int, min_rows: int) -> dict:
    """:func:`parallel.comm.in_row_shares` over the pool: every rank's result and the rows it computed."""
    from parallel.comm import in_row_shares

    computed = []

    def fn(share: dict) -> torch.Tensor:
        computed.extend(share["x"][:, 0].tolist())
        return share["x"] * 2 + share["y"][:, None]

    rows = {"x": torch.arange(count * 3, dtype=torch.float32).view(count, 3), "y": torch.arange(count) + 0.5}
    return {"result": in_row_shares(fn, rows, torch.distributed.group.WORLD, min_rows).tolist(), "computed": computed}
