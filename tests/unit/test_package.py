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
