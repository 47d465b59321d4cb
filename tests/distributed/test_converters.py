"""The converter CLIs: HF -> Megatron torch_dist -> HF bit-exact for every family; converted checkpoints load under
every layout; training checkpoints (any layout, with optimizer) convert to HF; memory stays far below the model's
size; bad input is refused before anything is written. Conversions run the CLI's entry point with its argv (the
memory test runs it in processes of their own, where peak RSS is the conversion's)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.hf_io import HFCheckpoint, copy_model_files
from mcore_rl import checkpoint, convert
from tests.distributed import cases
from tests.distributed.test_bridges import _layouts, dense_layouts
from tests.tiny import FAMILIES, make_tiny, make_tiny_kimi_k2

REPO = Path(__file__).resolve().parents[2]


def cli(name: str, *args) -> subprocess.CompletedProcess:
    """The converter ``name`` as its console script runs it (``mcore_rl.convert.main``: parsing, start-up checks,
    exit status, stdout and stderr), in this process: a subprocess would spend ~10 s importing Megatron-Core."""
    argv = [str(a) for a in (*args, "--quiet")]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = convert.main(name, argv)
        except SystemExit as err:  # argparse's usage errors
            code = err.code
    return subprocess.CompletedProcess([name, *argv], code, stdout.getvalue(), stderr.getvalue())


def peak_rss_kib(name: str, *args) -> int:
    """Peak resident memory (KiB) of ``python -m mcore_rl.convert NAME ARGS`` in a process of its own."""
    code = (
        "import resource, runpy, sys\n"
        f"sys.argv = ['convert', {name!r}, *{[str(a) for a in (*args, '--quiet')]!r}]\n"
        "try:\n"
        "    runpy.run_module('mcore_rl.convert', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return int(ok(run).stdout.split()[-1])


def ok(run: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def hf_tensors(directory) -> dict[str, torch.Tensor]:
    ckpt = HFCheckpoint(directory)
    return {name: ckpt.get(name) for name in ckpt.names()}


def assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_models) -> dict[str, dict[str, Path]]:
    """Per family: hf2mcore at TP=1; mcore2mcore of that to TP=2 (vocabulary re-padded); mcore2hf of the TP=2 one."""
    root = tmp_path_factory.mktemp("converted")

    def chain(arch: str) -> dict[str, Path]:
        out = {tp: root / arch / f"mcore_tp{tp}" for tp in (1, 2)} | {"hf": root / arch / "hf"}
        # gpt-oss's expert biases: experts without TP, so expert parallelism beside TP (test_bridges._layouts)
        experts = ("--etp", "1", "--ep", "2") if arch == "GptOssForCausalLM" else ()
        ok(cli("hf2mcore", tiny_models[arch], out[1], "--bucket-size", "64KB"))
        ok(cli("mcore2mcore", out[1], out[2], "--tp", "2", *experts, "--bucket-size", "64KB"))
        ok(cli("mcore2hf", out[2], out["hf"], "--max-shard-size", "1MB"))
        return out

    return {arch: chain(arch) for arch in FAMILIES}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_hf_megatron_hf_is_bit_exact(converted, tiny_models, arch):
    out = converted[arch]["hf"]
    assert_same_tensors(hf_tensors(out), hf_tensors(tiny_models[arch]))
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1  # sharded, with an index
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (Path(tiny_models[arch]) / name).read_bytes()
    assert not list(out.parent.glob(".*.partial"))


def test_kimi_k2_converts_both_ways_keeping_its_model_type(tmp_path):
    """A Kimi-K2 checkpoint (DeepSeek-V3's layers under model_type kimi_k2, its config naming remote code) through
    hf2mcore and mcore2hf: the same tensors bit for bit, and a config.json that is still Kimi-K2's."""
    source = make_tiny_kimi_k2(tmp_path / "kimi")
    ok(cli("hf2mcore", source, tmp_path / "mcore", "--bucket-size", "64KB"))
    ok(cli("mcore2hf", tmp_path / "mcore", tmp_path / "hf"))
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(source))
    config, original = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", source))
    assert config["model_type"] == "kimi_k2" and config["auto_map"] == original["auto_map"]


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_converted_checkpoint_loads_under_every_layout(ranks, converted, tiny_models, arch):
    for layout in _layouts(arch, dense_layouts(arch)):
        source = converted[arch][layout.get("tp", 1)]
        counts = ranks.run(
            cases.roundtrip, hf_dir=str(source), layout=layout, bucket_bytes=512 << 20, reference=tiny_models[arch]
        )
        assert len(set(counts)) == 1 and counts[0] > 0, (layout, counts)


def test_wrong_vocabulary_padding_is_refused_with_the_fix(ranks, converted):
    with pytest.raises(RuntimeError, match="padded to 128 rows.*pads it to 256.*mcore2mcore"):
        ranks.run(cases.roundtrip, hf_dir=str(converted["Qwen2ForCausalLM"][1]), layout=dict(tp=2), bucket_bytes=1)


@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("Qwen2ForCausalLM", dict(tp=2, pp=2)),
        ("Qwen3MoeForCausalLM", dict(tp=2, ep=2, sequence_parallel=True)),
        ("DeepseekV3ForCausalLM", dict(pp=2, ep=2)),
    ],
)
def test_training_checkpoint_converts_to_hf(ranks, tiny_models, tmp_path, arch, layout):
    """A checkpoint saved as training saves it (the policy trainer after a step at a sharded layout, optimizer state
    beside the model, the model's files copied in, committed) converts to exactly the weights the trainer exports,
    with no --hf-config needed (Qwen2 passes it anyway)."""
    partial, reference = checkpoint.partial_dir(tmp_path, 1), tmp_path / "reference.safetensors"
    ranks.run(
        cases.trained_checkpoint,
        hf_dir=tiny_models[arch],
        layout=layout,
        checkpoint_dir=str(partial),
        reference_file=str(reference),
    )
    copy_model_files(tiny_models[arch], partial)
    episode = checkpoint.commit(tmp_path, 1, {})
    hf_config = ["--hf-config", tiny_models[arch]] if arch == "Qwen2ForCausalLM" else []
    ok(cli("mcore2hf", episode, tmp_path / "hf", *hf_config))
    want = load_file(reference)
    assert_same_tensors(hf_tensors(tmp_path / "hf"), want)
    assert any(not torch.equal(t, hf_tensors(tiny_models[arch])[n]) for n, t in want.items())  # it trained
    files = {p.name for p in (tmp_path / "hf").iterdir() if not p.name.startswith("model")}
    model_files = {p.name for p in Path(tiny_models[arch]).iterdir() if not p.name.startswith("model")}
    assert files == model_files | {"mcore_rl_convert.json"}  # not the checkpoint's COMPLETE marker


def test_smollm2_roundtrip_is_bit_exact(tmp_path):
    from converters.gguf2hf import default_model_dir

    model = default_model_dir()
    ok(cli("hf2mcore", model, tmp_path / "mcore", "--tp", "3"))
    ok(cli("mcore2hf", tmp_path / "mcore", tmp_path / "hf"))
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(model))


def test_memory_stays_far_below_the_checkpoint_size(tmp_path):
    """An 0.9 GB multi-shard checkpoint converts both ways with a small fraction of it resident."""
    source = make_tiny(
        "Qwen2ForCausalLM",
        tmp_path / "big",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=8192,
        max_shard_size="100MB",
    )
    ckpt = HFCheckpoint(source)
    total = sum(math.prod(ckpt.shape(n)) * ckpt.dtype(n).itemsize for n in ckpt.names())
    files = len(list(source.glob("*.safetensors")))
    assert total > 850e6 and files >= 8

    bucket = ("--bucket-size", "32MB")
    baseline = peak_rss_kib("hf2mcore", source, tmp_path / "dry", "--dry-run", *bucket)
    to_megatron = peak_rss_kib("hf2mcore", source, tmp_path / "mcore", *bucket)
    to_hf = peak_rss_kib("mcore2hf", tmp_path / "mcore", tmp_path / "hf", "--max-shard-size", "100MB")
    for peak in (to_megatron, to_hf):
        # Above the imports: one parameter (fc1: gate + up + fused, 67 MB) and one bucket, not the 0.9 GB model.
        assert (peak - baseline) * 1024 < total / 4, (peak, baseline, total)
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(source))


def test_bad_input_is_refused_before_writing(tmp_path, tiny_models):
    qwen2 = Path(tiny_models["Qwen2ForCausalLM"])
    out = tmp_path / "out"
    run = ok(cli("hf2mcore", qwen2, out, "--dry-run"))
    assert "decoder.layers.self_attention.linear_qkv.weight" in run.stdout and "would write" in run.stdout
    assert not out.exists()

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    run = cli("hf2mcore", qwen2, out)
    assert run.returncode == 2 and "not empty (pass --force" in run.stderr
    assert (out / "keep.txt").read_text() == "mine"

    run = cli("hf2mcore", qwen2, tmp_path / "tp3", "--tp", "3")
    assert (
        run.returncode == 2
        and "'tp': 3" in run.stderr
        and "num_attention_heads=4 is not divisible by tp=3" in run.stderr
    )
    assert not (tmp_path / "tp3").exists()

    broken = tmp_path / "broken"  # one tensor dropped from a single-file copy
    broken.mkdir()
    tensors = hf_tensors(qwen2)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    (broken / "config.json").write_bytes((qwen2 / "config.json").read_bytes())
    run = cli("hf2mcore", broken, tmp_path / "from_broken")
    assert run.returncode == 2 and "model.layers.1.mlp.up_proj.weight" in run.stderr
    assert not (tmp_path / "from_broken").exists() and not list(tmp_path.glob(".from_broken*"))

    run = ok(cli("hf2mcore", qwen2, out, "--force"))
    assert not (out / "keep.txt").exists() and (out / "model" / "metadata.json").is_file()
    assert not list(tmp_path.glob(".out*"))  # the replaced output is gone once the new one is in place

    # --force never deletes its own input: the output is the checkpoint, or a directory holding it
    kept = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for target in (out, tmp_path):
        run = cli("mcore2hf", out, target, "--force")
        assert run.returncode == 2 and "holds the input" in run.stderr and "write the output somewhere" in run.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == kept


def _refused(run: subprocess.CompletedProcess, message: str, output: Path) -> None:
    """Exit status 2, one error line with ``message``, no traceback, and nothing at or beside ``output``."""
    assert run.returncode == 2 and run.stderr.startswith("error: ") and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not output.exists() and not list(output.parent.glob(f".{output.name}*"))


def test_broken_files_and_unsupported_models_are_named(tmp_path, converted, tiny_models):
    """A truncated safetensors file, a Megatron checkpoint missing a data file or holding a corrupted one, and an
    architecture no bridge declares: each is one error naming the file (or the architecture), and no partial output
    is left behind, however far the conversion got."""
    qwen3 = Path(shutil.copytree(tiny_models["Qwen3ForCausalLM"], tmp_path / "truncated"))
    weights = qwen3 / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    _refused(cli("hf2mcore", qwen3, tmp_path / "a"), f"{weights}: truncated", tmp_path / "a")

    gpt2 = Path(shutil.copytree(tiny_models["Qwen3ForCausalLM"], tmp_path / "gpt2"))
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    _refused(cli("hf2mcore", gpt2, tmp_path / "b"), "architecture 'GPT2LMHeadModel' is not supported", tmp_path / "b")

    source = converted["Qwen3ForCausalLM"][1]
    for damage in ("missing", "corrupted"):
        checkpoint = Path(shutil.copytree(source, tmp_path / damage))
        data = sorted((checkpoint / "model").glob("*.distcp"))[-1]
        if damage == "missing":
            data.unlink()
            message = f"data file {data.name} is missing"
        else:  # same size: the metadata check passes, the conversion fails when it reads this file
            data.write_bytes(bytes(data.stat().st_size))
            message = f"from {data.name} failed"
        out = tmp_path / f"hf_from_{damage}"
        _refused(cli("mcore2hf", checkpoint, out), message, out)


def test_block_fp8_checkpoint_converts_dequantized(tmp_path, tiny_models):
    """DeepSeek-V3's release stores its projections in FP8 with an inverse scale per 128x128 block: hf2mcore reads
    them as bf16 (here 48x48 blocks, so edge blocks are partial), mcore2hf writes that model with a config.json
    that no longer claims FP8. Other quantizations are refused by name before anything is written."""
    source, fp8, block = Path(tiny_models["DeepseekV3ForCausalLM"]), tmp_path / "fp8", 48
    fp8.mkdir()
    copy_model_files(source, fp8)
    stored, expected = {}, {}
    for name, weight in hf_tensors(source).items():
        stored[name] = expected[name] = weight
        if not name.endswith("proj.weight"):
            continue
        rows, cols = (math.ceil(n / block) for n in weight.shape)
        scale = torch.empty(rows, cols)
        quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
        dequantized = torch.empty(weight.shape, dtype=torch.bfloat16)
        for i in range(rows):
            for j in range(cols):
                part = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
                scale[i, j] = weight[part].abs().max() / 448  # the e4m3 range
                quantized[part] = (weight[part] / scale[i, j]).to(torch.float8_e4m3fn)
                dequantized[part] = (quantized[part].float() * scale[i, j]).to(torch.bfloat16)
        stored[name], stored[name + "_scale_inv"], expected[name] = quantized, scale, dequantized
    save_file(stored, fp8 / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    quantization = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[block] * 2)
    (fp8 / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))

    ok(cli("hf2mcore", fp8, tmp_path / "mcore"))
    ok(cli("mcore2hf", tmp_path / "mcore", tmp_path / "hf"))
    assert_same_tensors(hf_tensors(tmp_path / "hf"), expected)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == config

    (fp8 / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    run = cli("hf2mcore", fp8, tmp_path / "gptq")
    assert run.returncode == 2 and "quant_method='gptq'" in run.stderr, run.stderr
    assert not (tmp_path / "gptq").exists()


def test_mxfp4_experts_convert_dequantized(tmp_path, tiny_models):
    """gpt-oss's release stores its experts in MXFP4 (``*_blocks``: two e2m1 values a byte, ``*_scales``: a power of two
    per 32 values, the weight transposed): hf2mcore reads them as bf16, each EP rank's experts a slice of the stacked
    tensors, equal to what transformers' own dequantization makes of them; mcore2hf writes that model with a
    config.json that no longer claims MXFP4."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source, mxfp4 = Path(tiny_models["GptOssForCausalLM"]), tmp_path / "mxfp4"
    mxfp4.mkdir()
    copy_model_files(source, mxfp4)
    generator = torch.Generator().manual_seed(0)
    stored, expected = {}, {}
    for name, weight in hf_tensors(source).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name] = expected[name] = weight
            continue
        experts, rows, cols = weight.shape  # [E, in, out], stored as [E, out, in / 32, 16] bytes
        blocks = torch.randint(0, 256, (experts, cols, rows // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(120, 130, (experts, cols, rows // 32), dtype=torch.uint8, generator=generator)
        stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        assert expected[name].shape == weight.shape
    save_file(stored, mxfp4 / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    quantization = dict(quant_method="mxfp4", modules_to_not_convert=["model.layers.*.self_attn", "lm_head"])
    (mxfp4 / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))

    ok(cli("hf2mcore", mxfp4, tmp_path / "mcore", "--ep", "2"))
    ok(cli("mcore2hf", tmp_path / "mcore", tmp_path / "hf"))
    assert_same_tensors(hf_tensors(tmp_path / "hf"), expected)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == config


def test_a_converted_checkpoint_loads_into_modules_with_extra_state(ranks, converted, tiny_models):
    """TransformerEngine's core attention checkpoints an ``_extra_state`` that a checkpoint converted with the local
    layout lacks (issue 17, defect 7): a model with such modules loads it, and holds exactly its weights."""
    arch = "LlamaForCausalLM"
    absent = ranks.run(
        cases.load_into_te_like_attention,
        checkpoint_dir=str(converted[arch][2]),
        hf_dir=tiny_models[arch],
        layout=dict(tp=2),
    )
    assert absent[0] > 0  # the model did request state the checkpoint does not hold


def test_a_reward_models_score_head_converts_both_ways_bit_exact(ranks, tiny_models, tmp_path):
    """A one-label sequence classifier: its score head is the Megatron value head (``output_layer``, [1, hidden],
    replicated over TP) and comes back as ``score.weight``, with the classifier's architecture in config.json;
    the converted checkpoint loads under TP 2 (with PP 2) and exports every tensor bit-exact."""
    from tests.tiny import make_tiny_reward_model

    rm = make_tiny_reward_model(tiny_models["LlamaForCausalLM"], tmp_path / "rm")
    ok(cli("hf2mcore", rm, tmp_path / "mcore", "--tp", "2"))
    ok(cli("mcore2hf", tmp_path / "mcore", tmp_path / "hf"))
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(rm))
    assert "score.weight" in hf_tensors(rm) and not any(n.startswith("lm_head") for n in hf_tensors(rm))
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForSequenceClassification"]
    for layout in (dict(tp=2), dict(tp=2, pp=2)):
        counts = ranks.run(
            cases.roundtrip, hf_dir=str(tmp_path / "mcore"), layout=layout, bucket_bytes=1 << 20, reference=rm
        )
        assert len(set(counts)) == 1 and counts[0] > 0, (layout, counts)


def test_peft_adapters_that_are_not_mcore_rl_adapters_are_refused_by_name(tmp_path, tiny_models):
    """hf2mcore --peft takes plain LoRA whose q/k/v (and gate/up) are adapted together with one A, in every layer;
    anything else is named before a byte is written (its numerics: test_lora.py's SmolLM2 round trip)."""
    from converters.peft import CONFIG, WEIGHTS, peft_config

    llama = Path(tiny_models["LlamaForCausalLM"])
    shapes = HFCheckpoint(llama).shapes
    layers = json.loads((llama / "config.json").read_text())["num_hidden_layers"]

    def adapter(name: str, modules: list[str], layers_=range(layers), shared: bool = True, **config) -> Path:
        tensors, generator = {}, torch.Generator().manual_seed(0)
        for i in layers_:
            a = torch.randn(4, shapes[f"model.layers.{i}.{modules[0]}.weight"][1], generator=generator)
            for module in modules:
                out = shapes[f"model.layers.{i}.{module}.weight"][0]
                prefix = f"base_model.model.model.layers.{i}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = a.clone() if shared else torch.randn(a.shape, generator=generator)
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, 4, generator=generator)
        directory = tmp_path / name
        directory.mkdir()
        save_file(tensors, directory / WEIGHTS)
        settings = peft_config(4, 8.0, sorted({m.rsplit(".", 1)[-1] for m in modules}), str(llama)) | config
        (directory / CONFIG).write_text(json.dumps(settings))
        return directory

    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    assert ok(cli("hf2mcore", llama, tmp_path / "ok", "--peft", adapter("ok", qkv), "--dry-run"))
    for peft, message in [
        (adapter("q_only", qkv[:1]), "linear_qkv.weight: adapts ['model.layers.0.self_attn.q_proj'] but not"),
        (adapter("two_a", qkv, shared=False), "the lora_A of ['model.layers.0.self_attn.q_proj', "),
        (adapter("rslora", qkv, use_rslora=True), "use_rslora=True, expected False (mcore-rl's adapters are plain"),
        (adapter("one_layer", qkv, layers_=[0]), "decoder.layers.1.self_attention.linear_qkv.weight: not adapted by"),
        (tmp_path / "missing", "not a readable PEFT adapter"),
    ]:
        _refused(cli("hf2mcore", llama, tmp_path / "out", "--peft", peft), message, tmp_path / "out")
