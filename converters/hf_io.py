"""Reading Hugging Face checkpoint directories (config.json + safetensors, single file or sharded with an index)."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from converters.stacks import ExpertStacks

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; expected a Hugging Face model directory with config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON at line {err.lineno}: {err.msg}") from err


def load_tokenizer(hf_dir: str | Path):
    """The tokenizer of an HF directory, never running code the directory ships: where its tokenizer_config.json
    names a tokenizer class of its own (``auto_map``, Kimi-K2's tiktoken tokenizer), the directory's
    ``tokenizer.json`` is loaded as a fast tokenizer with the config's special tokens and chat template instead;
    without one, a ``ValueError`` names the code file. (transformers, asked to run such code, prompts for a yes on
    a terminal and waits.)"""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(hf_dir) / "tokenizer_config.json"
    auto_map = json.loads(config.read_text()).get("auto_map", {}) if config.is_file() else {}
    names = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    code = next((name for name in (names if isinstance(names, list) else [names]) if name), None)
    if code is None:
        return AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=False)
    if (Path(hf_dir) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(hf_dir)
    module = code.split("--")[-1].rsplit(".", 1)[0]
    raise ValueError(
        f"{Path(hf_dir) / (module + '.py')}: the tokenizer is the model's own code (tokenizer_config.json's "
        "auto_map), which mcore-rl does not run, and the directory has no tokenizer.json to load instead; save the "
        "tokenizer there as a fast tokenizer (tokenizer.json)"
    )


# Block-quantized FP8 checkpoints (DeepSeek-V3's release): each quantized weight has a float32 ``<name>_scale_inv``
# with one factor per block of ``quantization_config.weight_block_size``.
SCALE_SUFFIX = "_scale_inv"


def quantization(config: dict, where: str) -> tuple[str, tuple[int, int] | None] | None:
    """How ``config``'s (config.json's) weights are quantized: ``("fp8", block)`` or ``("mxfp4", None)``, or None."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method, block = quantization.get("quant_method"), quantization.get("weight_block_size")
    if method == "mxfp4":
        return method, None
    if method != "fp8" or not (isinstance(block, list) and len(block) == 2):
        raise ValueError(
            f"{where}: quantization_config quant_method={method!r}, weight_block_size={block!r}: only block FP8 "
            "(quant_method 'fp8' with [rows, cols] blocks, as DeepSeek-V3's release) and MXFP4 experts (gpt-oss's) "
            "are dequantized here; convert the checkpoint to bf16 first"
        )
    return method, (block[0], block[1])


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """bf16 ``weight * scale_inv`` per block (DeepSeek's reference dequantization; edge blocks may be partial)."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(torch.bfloat16)


# MXFP4 checkpoints (gpt-oss's release): a weight ``<name>`` [..., in, out] is stored transposed as
# ``<name>_blocks`` [..., out, in / 32, 16] uint8, two e2m1 values per byte (the low nibble first), and
# ``<name>_scales`` [..., out, in / 32] uint8, a power of two per 32 values with its exponent biased by 127.
MXFP4_SUFFIXES = ("_blocks", "_scales")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 weight [..., in, out] of MXFP4 ``blocks`` and ``scales`` (exact: every value is an e2m1 number times a
    power of two)."""
    values = torch.tensor(E2M1)[torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()]  # [..., out, G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(-1, -2).to(torch.bfloat16)


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file, checked against the file's size: a missing, truncated or foreign
    file is an error naming it, before any tensor is read."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"its header claims {length} bytes, the file has {size}")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        end = 8 + length + max((t["data_offsets"][1] for t in header.values()), default=0)
    except (OSError, struct.error, ValueError, TypeError, KeyError, IndexError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
    if end > size:
        raise ValueError(f"{path}: truncated: its header lists {end} bytes of tensors, the file has {size}")
    return header


class HFCheckpoint:
    """Lazy, per-tensor access to a checkpoint's safetensors: a rank reads only the tensors it asks for. Block FP8
    weights and MXFP4 experts read as bf16 (their scales are not listed), and where ``stacks`` is given, stacked
    expert tensors as one tensor per expert (:mod:`converters.stacks`, read as slices): converters and trainers see
    the model, not its storage. Every file's header is checked when the checkpoint is opened
    (:func:`safetensors_header`)."""

    def __init__(self, hf_dir: str | Path, stacks: ExpertStacks | None = None):
        self.dir = Path(hf_dir)
        config = self.dir / "config.json"
        quantized = quantization(read_config(self.dir), str(config)) if config.is_file() else None
        method, self.fp8_block = quantized or (None, None)
        self.mxfp4 = method == "mxfp4"
        self.stacks = stacks
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise ValueError(f"{index}: not a safetensors index with a weight_map ({err})") from None
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map = None
        else:
            raise FileNotFoundError(f"{self.dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
        self._stored: dict[str, dict] = {}  # name -> its header entry (dtype, shape, offsets)
        for file in files:
            if not (self.dir / file).is_file():
                raise FileNotFoundError(f"{self.dir / file}: listed in {INDEX_FILE} but missing")
            header = safetensors_header(self.dir / file)
            if weight_map is None:
                weight_map = dict.fromkeys(header, file)
            elif absent := {n for n, f in weight_map.items() if f == file} - header.keys():
                raise ValueError(
                    f"{self.dir / file}: lacks {len(absent)} tensor(s) of {INDEX_FILE}, e.g. {min(absent)}"
                )
            self._stored.update(header)
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}
        stored = dict(self._listed())
        self._shapes = stacks.split(stored) if stacks is not None else stored

    def names(self) -> set[str]:
        return set(self._shapes)

    def _listed(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Each tensor as the model sees it, with its shape: quantized ones under their own names (an MXFP4 one
        transposed back), their scales not at all."""
        for name in self.weight_map:
            if (
                self.fp8_block is not None
                and name.endswith(SCALE_SUFFIX)
                and name[: -len(SCALE_SUFFIX)] in self.weight_map
            ):
                continue
            base = name[: -len(MXFP4_SUFFIXES[0])]
            if (stored := self._mxfp4_of(base)) is None:
                yield name, tuple(self._stored[name]["shape"])
            elif name == stored[0]:
                *lead, out, groups, pairs = self._stored[name]["shape"]
                yield base, (*lead, groups * pairs * 2, out)

    def _mxfp4_of(self, name: str) -> tuple[str, str] | None:
        """The blocks and scales that store ``name`` in an MXFP4 checkpoint, or None."""
        stored = tuple(name + suffix for suffix in MXFP4_SUFFIXES)
        return stored if self.mxfp4 and all(n in self.weight_map for n in stored) else None

    def _scale_of(self, name: str) -> str | None:
        scale = name + SCALE_SUFFIX
        return scale if self.fp8_block is not None and scale in self.weight_map else None

    def _handle(self, name: str):
        file = self.weight_map.get(name)
        if file is None:
            raise KeyError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        if file not in self._handles:
            self._handles[file] = safe_open(self.dir / file, framework="pt")
        return self._handles[file]

    def _read(self, name: str, expert: int | None) -> torch.Tensor:
        handle = self._handle(name)
        return handle.get_tensor(name) if expert is None else handle.get_slice(name)[expert]

    def _stored_name(self, name: str) -> tuple[str, int | None]:
        """The stored tensor holding ``name`` and, for one expert's slice of a stacked tensor, the expert's index."""
        found = self.stacks.source(name) if self.stacks is not None else None
        return found if found is not None else (name, None)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        stored, expert = self._stored_name(name)
        if (mxfp4 := self._mxfp4_of(stored)) is not None:
            return dequantize_mxfp4(*(self._read(n, expert) for n in mxfp4))
        tensor = self._read(stored, expert)
        scale = self._scale_of(stored)
        return tensor if scale is None else dequantize_fp8(tensor, self._read(scale, expert), self.fp8_block)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape (quantization scales aside), from the headers: no data is read."""
        return dict(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        stored, _ = self._stored_name(name)
        if self._scale_of(stored) is not None or self._mxfp4_of(stored) is not None:
            return torch.bfloat16
        return _DTYPE_OF_NAME[self._stored[stored]["dtype"]]


# Files of a model directory that are not weights (config, tokenizer, generation settings): copied along.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json", ".distcp")


def copy_model_files(src: str | Path, dst: str | Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy ``src``'s top-level non-weight files (config.json, tokenizer files, ...) into ``dst``, except those named
    in ``skip``; from an FP8 checkpoint, config.json without its quantization_config (what is written beside it
    holds dequantized weights)."""
    copied = []
    for path in sorted(Path(src).iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name not in skip:
            shutil.copy2(path, Path(dst) / path.name)
            copied.append(path.name)
    config = Path(dst) / "config.json"
    if "config.json" in copied and "quantization_config" in (fields := read_config(dst)):
        del fields["quantization_config"]  # the weights written beside it are dequantized
        config.write_text(json.dumps(fields, indent=2) + "\n")
    return copied


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPE_OF_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def shard_files(entries: list[TensorEntry], max_shard_bytes: int) -> list[tuple[str, list[TensorEntry]]]:
    """HF's sharding: consecutive tensors up to ``max_shard_bytes`` per file (a larger tensor gets its own)."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return list(zip(shard_names(len(shards)), shards, strict=True))


def shard_names(n: int) -> list[str]:
    """HF's file names of a model in ``n`` safetensors files."""
    return [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_index(directory: Path, files: list[tuple[str, dict[str, int]]]) -> None:
    """HF's index of a model in several files: ``files`` as (file name, {tensor name: bytes})."""
    total = sum(sum(sizes.values()) for _, sizes in files)
    weight_map = {name: file for file, sizes in files for name in sizes}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


class SafetensorsWriter:
    """HF safetensors shards (plus the index when there are several) written tensor by tensor, in a planned order.

    The safetensors header lists every tensor's offsets, so it is written from the plan before any data: memory
    holds one tensor at a time, never a shard.
    """

    def __init__(self, directory: str | Path, entries: list[TensorEntry], max_shard_bytes: int):
        self.dir = Path(directory)
        self.shards = shard_files(entries, max_shard_bytes)
        self.queue = iter([(file, e) for file, shard in self.shards for e in shard])
        self.file = None
        self.current = ""

    def _close_file(self) -> None:
        if self.file:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None

    def _open(self, name: str, shard: list[TensorEntry]) -> None:
        self._close_file()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for e in shard:
            header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape)}
            header[e.name]["data_offsets"] = [offset, offset + e.nbytes]
            offset += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the format aligns data to 8 bytes
        self.file = open(self.dir / name, "wb")  # noqa: SIM115 - open across calls, closed in _open/close
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.current = name

    def write(self, name: str, tensor: torch.Tensor) -> None:
        file, entry = next(self.queue, (None, None))
        if entry is None or entry.name != name or entry.dtype != tensor.dtype or entry.shape != tuple(tensor.shape):
            raise ValueError(f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} out of plan (expected {entry})")
        if file != self.current:
            self._open(file, next(shard for f, shard in self.shards if f == file))
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        if next(self.queue, None) is not None:
            raise ValueError(f"{self.dir}: closed before every planned tensor was written")
        self._close_file()
        if len(self.shards) > 1:
            write_index(self.dir, [(file, {e.name: e.nbytes for e in shard}) for file, shard in self.shards])


class StreamedShards:
    """HF safetensors shards written from a stream of tensors whose names and sizes are not planned ahead (a model
    exported by its trainer): consecutive tensors up to ``max_shard_bytes`` per file, as :func:`shard_files` lays
    them out; a shard is held in memory until full, and the files take HF's names (with the index) at
    :meth:`close`."""

    def __init__(self, directory: str | Path, max_shard_bytes: int):
        self.dir, self.max = Path(directory), max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[dict[str, int]] = []  # per written file: tensor name -> bytes

    def write(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, str(self.dir / f".shard-{len(self.shards)}"), metadata={"format": "pt"})
        self.shards.append({name: t.numel() * t.element_size() for name, t in self.pending.items()})
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        files = shard_names(len(self.shards))
        for i, file in enumerate(files):
            (self.dir / f".shard-{i}").rename(self.dir / file)
        if len(files) > 1:
            write_index(self.dir, list(zip(files, self.shards, strict=True)))
