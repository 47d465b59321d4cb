"""Atomic checkpoint directories: a checkpoint either is complete or does not look like one.

Every rank writes into ``<root>/.episode_<n>.partial``; once all have finished (a barrier), one rank writes the
``COMPLETE`` marker and renames the directory to ``<root>/episode_<n>``. A crash at any point leaves either the
previous checkpoints untouched plus a partial directory (ignored and cleared on the next save), or a complete one.
Resume takes the highest complete episode.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

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
    """Mark episode ``episode``'s partial directory complete and move it into place (one rank, after a barrier)."""
    partial, final = Path(root) / f".episode_{episode}.partial", final_dir(root, episode)
    marker = partial / MARKER
    with open(marker, "w") as f:
        json.dump({"episode": episode, "time": time.time(), **meta}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(partial, final)  # atomic on one filesystem
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def complete(root: str | Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint under ``root`` as (episode, path), oldest first."""
    root = Path(root)
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _NAME.match(path.name)
        if match and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
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
    found = complete(root)
    doomed = [path for _, path in found[: max(len(found) - keep, 0)]] if keep > 0 else []
    for path in doomed:
        (path / MARKER).unlink()
        shutil.rmtree(path)
    return doomed


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / MARKER).read_text())
