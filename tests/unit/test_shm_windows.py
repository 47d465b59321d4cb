"""A shared-memory window (:mod:`parallel.shm`) is the creator's alone and allocated when it is made: where the
space is not there, making it fails at once (and leaves no file), never with a SIGBUS at a later write."""

from __future__ import annotations

import stat
import subprocess
import sys

from parallel.shm import _map_file


def test_a_window_is_private_to_its_user_and_allocated_up_front(tmp_path):
    window = _map_file(tmp_path / "w", 1 << 20, create=True)
    info = (tmp_path / "w").stat()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_blocks * 512 >= 1 << 20  # allocated, not sparse
    window[-1] = 7
    assert _map_file(tmp_path / "w", 1 << 20, create=False)[-1] == 7  # a peer's view of the same bytes


def test_a_window_without_the_space_for_it_is_an_error_and_leaves_no_file(tmp_path):
    """A file-size limit stands in for a full /dev/shm (both refuse the allocation)."""
    code = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from parallel.shm import _map_file\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "try:\n"
        f"    _map_file(Path({str(tmp_path)!r}) / 'w', 8 << 20, create=True)\n"
        "except OSError as error:\n"
        "    print('refused', error.errno)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("refused"), run.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
