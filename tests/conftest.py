"""Session fixtures: tiny HF models per family and one pool of gloo ranks shared by all distributed tests."""

from __future__ import annotations

import pytest

from tests.tiny import FAMILIES, make_tiny

WORLD_SIZE = 4


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: str(make_tiny(arch, root / arch)) for arch in FAMILIES}


@pytest.fixture(scope="session")
def ranks():
    from tests.distributed.pool import RankPool

    pool = RankPool(WORLD_SIZE)
    yield pool
    pool.close()
