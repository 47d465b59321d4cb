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


def latest_complete(root: str | Path) -> tuple[int, Path] | None:
    """The highest episode with a complete checkpoint under ``root``, or None."""
    root = Path(root)
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _NAME.match(path.name)
        if match and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return max(found) if found else None


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / MARKER).read_text())
