"""The peer's own venv (default ``<repo>/.venv-peer``, or ``MCORE_RL_PEER_VENV``): TRL from PyPI beside the same
torch build as the project's (its pin in ``requirements/<device>.txt``, found where ``scripts/setup_env.sh`` finds
it). Built once; rebuilt when the requirements change."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

from parallel.device import Device

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
log = logging.getLogger(__name__)


def torch_pin() -> str:
    device = "cuda" if Device.current().cuda else "cpu"
    lines = (REPO / "requirements" / f"{device}.txt").read_text().splitlines()
    return next(line.split()[0] for line in lines if line.startswith("torch=="))


def peer_python() -> Path:
    venv = Path(os.environ.get("MCORE_RL_PEER_VENV", REPO / ".venv-peer"))
    stamp = venv / ".stamp"
    want = hashlib.sha256((REQUIREMENTS.read_text() + torch_pin()).encode()).hexdigest()
    if not stamp.is_file() or stamp.read_text() != want:
        log.info("building the peer venv %s (TRL from PyPI)", venv)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        index = subprocess.run(["bash", str(REPO / "scripts/setup_env.sh"), "--index-args"], check=True,
                               capture_output=True, text=True).stdout.split()  # fmt: skip
        pip = [str(venv / "bin/python"), "-m", "pip", "--disable-pip-version-check", "-q"]
        subprocess.run([*pip, "install", *index, torch_pin(), "-r", str(REQUIREMENTS)], check=True)
        stamp.write_text(want)
    return venv / "bin/python"
