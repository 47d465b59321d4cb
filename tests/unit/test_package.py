"""The design card's top-level folders are this repo's packages, not same-named installed ones."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["mcore_rl", "converters", "parallel", "models"])
def test_top_level_package_resolves_inside_repo(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().is_relative_to(REPO / name), spec.origin


@pytest.mark.parametrize("name", ["hf2mcore", "mcore2hf", "mcore2mcore"])
def test_converter_cli_help_and_console_script(name):
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", f"converters.{name}", "--help"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "--dry-run" in run.stdout and "--force" in run.stdout
    assert f'"mcore-rl-{name}=converters.{name}:main"' in (REPO / "setup.py").read_text()
