"""Atomic checkpoint directories: a checkpoint either is complete or does not look like one.

Every rank writes into ``<root>/.episode_<n>.partial``; once all have finished (a barrier), one rank writes the
``COMPLETE`` marker and renames the directory to ``<root>/episode_<n>``. A crash at any point leaves either the
previous checkpoints untouched plus a partial directory (ignored and cleared on the next save), or a complete one.
Resume takes the highest complete episode.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

# Megatron-Core's two layouts of the distributed optimizer's state in a trained role's checkpoint
# (distrib_optimizer.py:1175), and the keys of its content metadata that record which it holds and under which
# parallel layout (:meth:`mcore_rl.trainer.ranks.TrainableRank.save`).
PER_RANK, RESHARDABLE = "dp_reshardable", "fully_reshardable"
OPTIMIZER_LAYOUT, PARALLEL_LAYOUT = "mcore_rl_optimizer_layout", "mcore_rl_parallel_layout"


class CheckpointError(RuntimeError):
    """A save that could not finish (a full disk, a failing file system): its partial directory is removed, the
    earlier checkpoints are as they were, and the run stops."""


def abandon(root: str | Path, episode: int) -> None:
    """Remove episode ``episode``'s partial directory (a failed save), freeing what it took."""
    shutil.rmtree(Path(root) / f".episode_{episode}.partial", ignore_errors=True)


MARKER = "COMPLETE"
_NAME = re.compile(r"^episode_(\d+)$")


def final_dir(root: str | Path, episode: int) -> Path:
    return Path(root) / f"episode_{episode}"


def partial_dir(root: str | Path, episode: int) -> Path:
    """Where every rank writes episode ``episode``'s checkpoint before it is committed (created, emptied)."""
    path = Path(root) / f".episode_{episode}.partial"
    if final_dir(root, episode).exists():
        raise FileExistsError(f"{final_dir(root, episode)}: a checkpoint of episode {episode} exists already")
    shutil.rmtree(path, ignore_errors=True)  # a crashed earlier attempt
    path.mkdir(parents=True)
    return path


def commit(root: str | Path, episode: int, meta: dict) -> Path:
    """Mark episode ``episode``'s partial directory complete and move it into place (one rank, after a barrier).

    Every file and directory in it is fsynced first, and the marker lists the files with their sizes: a power
    cut after the rename cannot leave a marked checkpoint whose data never reached the disk, and one whose files
    changed afterwards no longer counts as complete."""
    partial, final = Path(root) / f".episode_{episode}.partial", final_dir(root, episode)
    files = {}
    for path in sorted(partial.rglob("*")):
        _fsync(path)
        if path.is_file():
            files[str(path.relative_to(partial))] = path.stat().st_size
    marker = partial / MARKER
    with open(marker, "w") as f:
        json.dump({"episode": episode, "time": time.time(), **meta, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync(partial)
    os.rename(partial, final)  # atomic on one filesystem
    _fsync(Path(root))
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not complete (no or unreadable marker, a listed file missing or of
    another size), or None."""
    try:
        files = json.loads((path / MARKER).read_text()).get("files", {})  # older markers list no files
    except (OSError, ValueError) as err:
        return f"its {MARKER} marker is unreadable ({err})"
    for name, size in files.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if (path / name).stat().st_size != size:
            return f"{name} is {(path / name).stat().st_size} bytes, the marker says {size}"
    return None


def complete(root: str | Path, report: bool = True) -> list[tuple[int, Path]]:
    """Every complete checkpoint under ``root`` as (episode, path), oldest first; a marked one that fails its
    marker's check is left out, and logged where ``report`` (the resume's look, once a run: not the preflight's
    before it, or each save's prune after it)."""
    root = Path(root)
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _NAME.match(path.name)
        if match and (path / MARKER).is_file():
            if (why := problem(path)) is None:
                found.append((int(match.group(1)), path))
            elif report:
                log.warning("checkpoint %s is not complete: %s; it is skipped", path, why)
    return sorted(found)


def latest_complete(root: str | Path) -> tuple[int, Path] | None:
    """The highest episode with a complete checkpoint under ``root``, or None."""
    found = complete(root)
    return found[-1] if found else None


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (``keep`` <= 0 keeps all); returns what went.

    Called after a commit, so the newest complete checkpoint is never the one deleted; the marker goes first,
    so a crash mid-delete leaves a directory that no longer counts as complete.
    """
    found = complete(root, report=False)
    doomed = [path for _, path in found[: max(len(found) - keep, 0)]] if keep > 0 else []
    for path in doomed:
        (path / MARKER).unlink()
        shutil.rmtree(path)
    return doomed


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / MARKER).read_text())


def parallel_layout(parallel, world: int) -> dict:
    """What a role's per-rank optimizer state must be loaded under: every parallel size of its ``world`` ranks."""
    p = parallel
    return dict(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.expert_tp, cp=p.cp, dp=p.dp(world),
                first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers)  # fmt: skip


def optimizer_layout(role_dir: str | Path, layout: dict) -> str:
    """How the role checkpoint in ``role_dir`` holds its optimizer state (:data:`PER_RANK` or :data:`RESHARDABLE`;
    checkpoints without the record are gathered); ``ValueError`` where it is per rank under another ``layout``."""
    from megatron.core import dist_checkpointing

    content = dist_checkpointing.load_content_metadata(str(role_dir)) or {}
    saved = content.get(OPTIMIZER_LAYOUT, RESHARDABLE)
    if saved == PER_RANK and content[PARALLEL_LAYOUT] != layout:
        raise ValueError(
            f"{role_dir}: its optimizer state was saved per rank under the layout {content[PARALLEL_LAYOUT]} and "
            f"loads under that one only; this run's is {layout}. Resume with the checkpoint's parallel sizes and "
            "devices, or save with runtime_args.save_reshardable=true where a run must change them"
        )
    return saved
