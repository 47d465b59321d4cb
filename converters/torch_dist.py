"""Megatron distributed checkpoints (``torch_dist``) written and read by one process, one tensor group at a time.

Megatron stores a model under layout-free keys: TP shards are chunks of the full tensor, layers and experts are
offsets along prepended axes (``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of shape
``(layers, experts, 2F, H)``), VPP chunks and PP stages fill offsets of the same keys. So a checkpoint written
as whole tensors loads under any TP/PP/VPP/EP/ETP layout (only the padded vocabulary depends on TP), and any
layout's checkpoint reads back as whole tensors. The :class:`Schema` says where each Megatron parameter lives in
those keys; it comes from Megatron's own ``sharded_state_dict`` of the model built on the meta device, so it is
exactly what Megatron saves and loads.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories, is_main_replica
from megatron.core.dist_checkpointing.state_dict_utils import extract_sharded_base
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.utils import extract_nonpersistent
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from converters.plan import ADAPTERS, local_params, router_copy
from parallel.config import ParallelConfig
from parallel.groups import fake_world, init_parallel

EMBEDDING_KEY = "embedding.word_embeddings.weight"
CONFIG_FILE = "metadata.json"  # Megatron's marker of a distributed checkpoint and its backend
MODEL_SUBDIR = "model"  # a converted checkpoint: <dir>/config.json, tokenizer files, <dir>/model (torch_dist)
TRAINER_SUBDIR = "policy"  # a training checkpoint (episode_<n>): model, optimizer and schedule under policy/
LORA_FILE = "lora.json"  # beside a LoRA run's torch_dist files: {"rank", "alpha"} of its adapters


def find_megatron(path: str | Path) -> Path | None:
    """The torch_dist directory of a Megatron checkpoint at ``path`` (itself, ``model/`` or ``policy/``)."""
    for candidate in (Path(path), Path(path) / MODEL_SUBDIR, Path(path) / TRAINER_SUBDIR):
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    return None


def model_state(chunks: list[torch.nn.Module]) -> dict:
    """The sharded state dict of a rank's model chunks (unwrapped GPTModels), as checkpoints hold it. The metadata
    names the DP x CP group, as Megatron's training loop passes it (a stage with MTP layers but no embedding of its
    own ties its copy of the embedding with it)."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    return {
        f"model{i}": chunk.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
        for i, chunk in enumerate(chunks)
    }


@dataclass(frozen=True)
class Piece:
    """A part of a full Megatron tensor stored under ``key`` at ``offset``: the view (``size``, ``stride``,
    ``storage_offset``) of the full tensor, stored with ``prepend`` leading axes of length one."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    prepend: int

    def of(self, full: torch.Tensor) -> torch.Tensor:
        return full.as_strided(self.size, self.stride, self.storage_offset)

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(torch.Size(self.offset), torch.Size((1,) * self.prepend + self.size))


@dataclass(frozen=True)
class Slot:
    """One Megatron parameter (global name, as the mappings speak) and where its full tensor is stored."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Schema:
    """Where a model's parameters live in a checkpoint, plus the small objects Megatron stores beside them."""

    slots: list[Slot]
    objects: dict[str, object]  # ShardedObject unique key -> data (Megatron's per-layer ``_extra_state``)
    common: dict  # Megatron's common.pt

    def keys(self) -> dict[str, tuple[int, ...]]:
        return {p.key: p.global_shape for s in self.slots for p in s.pieces}


def model_schema(bridge, padded_vocab_size: int, adapt=None) -> Schema:
    """The schema of ``bridge``'s model, from Megatron's sharded state dict of one rank holding all of it (meta);
    ``adapt(chunks)`` attaches LoRA adapters to it (slots ``lora.<key>.a``/``.b``, named as their parameters).

    Needs a process without torch.distributed (it builds under a fake world of one rank)."""
    parallel = ParallelConfig()
    with fake_world(1, 0):
        init_parallel(parallel)
        config = bridge.transformer_config(parallel, params_dtype=torch.bfloat16)
        chunks = bridge.build_model(config, backend="local", meta=True, padded_vocab_size=padded_vocab_size)
        if adapt is not None:
            adapt(chunks)
        names = {id(lp.param): lp.slot for lp in local_params(chunks)}
        names |= {id(p): n for c in chunks for n, p in c.named_parameters() if n.startswith(ADAPTERS)}
        state = model_state(chunks)
        apply_factories(state)
        extract_nonpersistent(state)
        sharded, common = extract_sharded_base(state)
    pieces: dict[str, list[Piece]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    objects = {}
    for item in nested_values(sharded):
        if not is_main_replica(item.replica_id):
            continue
        if isinstance(item, ShardedObject):
            objects[item.unique_key] = item.data
            continue
        assert isinstance(item, ShardedTensor) and item.flattened_range is None, item
        param = item.data if item.data._base is None else item.data._base
        name = names.get(id(param))
        if name is None:
            raise ValueError(f"{item.key}: Megatron checkpoints a tensor that is no parameter of the mappings")
        shapes[name] = tuple(param.shape)
        pieces.setdefault(name, []).append(
            Piece(
                item.key,
                tuple(item.global_shape),
                tuple(item.global_offset),
                tuple(item.data.shape),
                tuple(item.data.stride()),
                item.data.storage_offset(),
                item.prepend_axis_num,
            )
        )
    slots = [Slot(name, shapes[name], tuple(ps)) for name, ps in pieces.items()]
    return Schema(slots, objects, common)


class _Data:
    """What DCP's storage layer asks a planner for: the bytes or tensor of a write item, the target of a read."""

    def __init__(self, by_index: dict):
        self.by_index = by_index

    def resolve_data(self, item):
        return self.by_index[item.index]

    def resolve_tensor(self, item):
        out = self.by_index[item.dest_index]
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
            out = out.narrow(dim, start, length)
        return out

    def commit_tensor(self, item, tensor):
        pass


class Writer:
    """Writes a torch_dist checkpoint in byte buckets (one DCP file each), so memory holds about one bucket.

    The directory is a checkpoint only after :meth:`close` wrote DCP's ``.metadata``, ``common.pt`` and
    Megatron's ``metadata.json`` (in that order: Megatron looks for the last)."""

    def __init__(self, directory: str | Path, bucket_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.storage = FileSystemWriter(self.dir, sync_files=True)
        self.bucket_bytes = bucket_bytes
        self.items: list[WriteItem] = []
        self.data: dict[MetadataIndex, object] = {}
        self.pending = 0
        self.files = 0
        self.metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self.results = []
        self.bytes_written = 0

    def tensor(self, piece: Piece, tensor: torch.Tensor) -> None:
        chunk = piece.chunk
        properties = TensorProperties(dtype=tensor.dtype)
        stored = self.metadata.setdefault(
            piece.key, TensorStorageMetadata(properties, torch.Size(piece.global_shape), [])
        )
        if stored.properties.dtype != tensor.dtype:
            raise ValueError(f"{piece.key}: {tensor.dtype} chunk in a {stored.properties.dtype} tensor")
        stored.chunks.append(chunk)
        index = MetadataIndex(piece.key, chunk.offsets)
        self.items.append(
            WriteItem(
                index,
                WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk, properties, torch.Size(piece.global_shape)),
            )
        )
        stored_bytes = tensor.numel() * tensor.element_size()
        data = tensor.reshape(chunk.sizes)
        if not data.is_contiguous() or data.untyped_storage().nbytes() != stored_bytes:
            data = data.clone(memory_format=torch.contiguous_format)  # torch.save would store the whole base
        self.data[index] = data
        self._grow(stored_bytes)

    def object(self, unique_key: str, data: object) -> None:
        buffer = io.BytesIO()
        torch.save([data], buffer)  # as Megatron's torch_dist strategy stores ShardedObjects
        self.metadata[unique_key] = BytesStorageMetadata()
        index = MetadataIndex(unique_key)
        self.items.append(WriteItem(index, WriteItemType.BYTE_IO))
        self.data[index] = buffer
        self._grow(buffer.getbuffer().nbytes)

    def _grow(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.items:
            return
        # A distinct "rank" per bucket gives each file its own name prefix (__<n>_0.distcp).
        self.storage.set_up_storage_writer(True, rank=self.files, use_collectives=False)
        plan = self.storage.prepare_local_plan(SavePlan(self.items))
        self.results.append(self.storage.write_data(plan, _Data(self.data)).wait())
        self.bytes_written += self.pending
        self.items, self.data, self.pending, self.files = [], {}, 0, self.files + 1

    def close(self, common: dict) -> None:
        self.flush()
        self.storage.set_up_storage_writer(True)
        self.storage.finish(Metadata(self.metadata), self.results)
        torch.save(common, self.dir / COMMON_STATE_FNAME)
        save_config(CheckpointingConfig("torch_dist", 1), str(self.dir))


class Reader:
    """Reads whole Megatron tensors from a torch_dist checkpoint saved under any layout."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not (self.dir / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{self.dir}: no {CONFIG_FILE}; not a complete Megatron distributed checkpoint")
        self.storage = FileSystemReader(self.dir)
        self.metadata = self.storage.read_metadata()
        self.storage.set_up_storage_reader(self.metadata, True)
        self.tensors = {
            k: md for k, md in self.metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
        }

    def padded_vocab_size(self) -> int:
        md = self.tensors.get(EMBEDDING_KEY)
        if md is None:
            raise ValueError(f"{self.dir}: holds no {EMBEDDING_KEY}; not a GPT model checkpoint")
        return md.size[0]

    def dtype(self, slot: Slot) -> torch.dtype:
        return self.tensors[slot.pieces[0].key].properties.dtype

    def problems(self, schema: Schema) -> list[str]:
        """What this checkpoint lacks for ``schema``: keys, global shapes, stored ranges (checked on metadata), and
        the data files its metadata points into (each present and long enough)."""
        stored = self.tensors
        problems = self.missing_data()
        for key, shape in schema.keys().items():
            md = stored.get(key)
            if md is None:
                problems.append(f"missing key {key}")
            elif tuple(md.size) != shape:
                problems.append(f"{key}: stored shape {tuple(md.size)}, the model's is {shape}")
        if problems:
            return problems
        for slot in schema.slots:
            for piece in slot.pieces:
                items = create_read_items_for_chunk_list(piece.key, stored[piece.key], [piece.chunk])
                if sum(math.prod(i.lengths) for i in items) != math.prod(piece.chunk.sizes):
                    problems.append(f"{slot.name}: not all of it is stored under {piece.key} at {piece.offset}")
        return problems

    def missing_data(self) -> list[str]:
        """Data files the metadata points into that are absent or shorter than it says (a copy cut short)."""
        ends: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        problems = []
        for name, end in sorted(ends.items()):
            path = self.dir / name
            if not path.is_file():
                problems.append(f"data file {name} is missing")
            elif path.stat().st_size < end:
                problems.append(f"data file {name} is truncated: {path.stat().st_size} bytes, the metadata needs {end}")
        return problems

    def whole(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor stored under ``key`` (as one piece of a slot of its own)."""
        shape = tuple(self.tensors[key].size)
        stride = torch.empty(shape, device="meta").stride()
        return self.read(Slot(key, shape, (Piece(key, shape, (0,) * len(shape), shape, stride, 0, 0),)), dtype)

    def read(self, slot: Slot, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full tensor of ``slot`` (in its stored dtype unless ``dtype``)."""
        full = torch.empty(slot.shape, dtype=dtype or self.dtype(slot))
        stored, requests, targets = self.tensors, [], {}
        for piece in slot.pieces:
            chunk = piece.chunk
            items = create_read_items_for_chunk_list(piece.key, stored[piece.key], [chunk])
            requests += items
            targets[items[0].dest_index] = piece.of(full).view(chunk.sizes)
        try:
            self.storage.read_data(LoadPlan(requests), _Data(targets)).wait()
        except Exception as err:  # noqa: BLE001 - whatever decoding a damaged file raises, reported by file
            files = sorted({self.metadata.storage_data[r.storage_index].relative_path for r in requests})
            raise ValueError(
                f"{self.dir}: reading {slot.name} from {', '.join(files)} failed ({type(err).__name__}: {err})"
            ) from None
        return full


def load_model(chunks: list[torch.nn.Module], directory: str | Path) -> None:
    """Fill this rank's shards of ``chunks`` from a torch_dist checkpoint of any layout (Megatron reshards)."""
    from megatron.core import dist_checkpointing

    reader = Reader(directory)
    if missing := reader.missing_data():
        raise ValueError(f"{directory}: incomplete checkpoint: " + "; ".join(missing))
    stored = reader.padded_vocab_size()
    ours = next((c.embedding.word_embeddings for c in chunks if hasattr(c, "embedding")), None)
    if ours is not None and ours.num_embeddings != stored:
        raise ValueError(
            f"{directory}: the vocabulary is padded to {stored} rows, this layout pads it to {ours.num_embeddings}; "
            f"convert it for this TP size with mcore-rl-mcore2mcore"
        )
    request = model_state(chunks)
    stored_adapters = sorted(k for k in reader.tensors if k.startswith(ADAPTERS))
    if stored_adapters and not any(getattr(t, "key", "").startswith(ADAPTERS) for t in nested_values(request)):
        raise ValueError(
            f"{directory}: holds LoRA adapters ({len(stored_adapters)} tensors, e.g. {stored_adapters[0]}) and this "
            "model has none: starting from it would drop them; export the merged model with mcore-rl-mcore2hf "
            "--merge and start from that, or resume the LoRA run itself"
        )
    # TransformerEngine's modules checkpoint an ``_extra_state`` (FP8 scaling metadata) that Megatron's local
    # modules lack: a checkpoint converted with the local layout (hf2mcore's) has none for TransformerEngine's core
    # attention. Such a module keeps its initial state, which is what it starts from in any run without FP8 history.
    keys = set(reader.metadata.state_dict_metadata)
    kept = _unrequest(
        request, lambda k, v: isinstance(v, ShardedObject) and k.endswith("_extra_state") and v.unique_key not in keys
    )
    # A LoRA run starting from a model: its adapters start fresh; one training the routers of a checkpoint that kept
    # them frozen: their copies start from the routers it loads (models.lora.keep_routers).
    kept |= _unrequest(
        request,
        lambda k, v: (
            (key := getattr(v, "key", "")).startswith(ADAPTERS)
            and (not stored_adapters or (router_copy(key) and key not in reader.tensors))
        ),
    )
    state = dist_checkpointing.load(request, str(directory))
    for path, value in kept.items():
        _put(state, path, value)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"model{i}"])


def _unrequest(state: dict, absent) -> dict[tuple, object]:
    """Take the entries the checkpoint does not hold (``absent(key, entry)``) out of the load request ``state``;
    returns them (path -> the module's current value) for the caller to put back after the load, so that their
    modules keep what they hold (Megatron's load fails on every key it requests and does not find)."""
    kept = {}

    def walk(node: dict, path: tuple) -> None:
        for key, value in list(node.items()):
            if isinstance(value, dict):
                walk(value, (*path, key))
            elif absent(key, value):
                kept[(*path, key)] = value.data
                del node[key]

    walk(state, ())
    return kept


def _put(state: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value
