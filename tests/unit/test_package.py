"""The design card's top-level folders are this repo's packages, not same-named installed ones."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["mcore_rl", "converters", "parallel", "models", "compat"])
def test_top_level_package_resolves_inside_repo(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().is_relative_to(REPO / name), spec.origin


# Every command a user runs: (its console script's entry point or None, module run with -m, arguments).
CLIS = [
    ("mcore-rl-hf2mcore=mcore_rl.convert:hf2mcore", "mcore_rl.convert", ["hf2mcore"]),
    ("mcore-rl-mcore2hf=mcore_rl.convert:mcore2hf", "mcore_rl.convert", ["mcore2hf"]),
    ("mcore-rl-mcore2mcore=mcore_rl.convert:mcore2mcore", "mcore_rl.convert", ["mcore2mcore"]),
    ("mcore-rl-plan=mcore_rl.planner.__main__:main", "mcore_rl.planner", []),
    ("mcore-rl-gguf2hf=converters.gguf2hf:main", "converters.gguf2hf", []),
    ("mcore-rl-check-template=mcore_rl.agent.template_audit:main", "mcore_rl.agent.template_audit", []),
    (None, "mcore_rl.train", []),
]
HEAVY = ("torch", "megatron", "transformers", "ray", "vllm", "safetensors")

_HELP = """
import json, runpy, sys
sys.argv = ["cli", *sys.argv[2:], "--help"]
try:
    runpy.run_module(sys.argv_module, run_name="__main__")
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "heavy": sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))}))
"""


@pytest.mark.parametrize(("script", "module", "args"), CLIS, ids=[m + " " + " ".join(a) for _, m, a in CLIS])
def test_cli_help_answers_before_importing_any_heavy_package(script, module, args):
    """``--help`` is parsed before torch, Megatron-Core, Ray or vLLM are imported (each takes seconds; together
    about 9 s before this was so), and prints no warning."""
    import json
    import subprocess
    import sys

    code = _HELP.replace("sys.argv_module", repr(module)).replace("set(HEAVY)", repr(set(HEAVY)))
    run = subprocess.run(
        [sys.executable, "-c", code, module, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "heavy": []}, run.stdout + run.stderr
    assert "usage:" in run.stdout and run.stderr == ""
    assert script is None or f'"{script}"' in (REPO / "setup.py").read_text()


# The modules whose classes Ray starts in CPU actors (each process imports the class's module): environments, tools,
# agent programs, reward functions, judges' parsers. Many start and restart in a run (one per timed-out call).
CPU_ACTOR_MODULES = ["mcore_rl.agent.actors", "mcore_rl.rewards.user", "mcore_rl.rewards.judge"]


def test_cpu_actors_import_no_framework():
    """A CPU actor's process imports neither torch, Megatron-Core, transformers nor vLLM (torch alone is 2 s of CPU
    per process)."""
    import json
    import subprocess
    import sys

    code = f"import json, sys; import {', '.join(CPU_ACTOR_MODULES)}; print(json.dumps(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    loaded = {m.split(".")[0] for m in json.loads(run.stdout)}
    frameworks = {"torch", "megatron", "transformers", "vllm"}
    assert not loaded & frameworks, sorted(loaded & frameworks)


def test_every_third_party_import_is_an_install_requirement():
    """``pip install -e .`` alone gives a package that runs: each distribution the library code imports (at the top
    or inside a function) is in setup.py's install_requires, or in an extra for the engine packages."""
    import ast
    import importlib.metadata
    import re
    import sys

    setup = (REPO / "setup.py").read_text()
    declared = {re.split(r"[\[<>=!;]", r)[0].lower().replace("_", "-") for r in re.findall(r'"([A-Za-z][^"]*)"', setup)}
    distributions = importlib.metadata.packages_distributions()
    first_party = {"mcore_rl", "converters", "models", "parallel", "compat"}
    missing = {}
    for package in first_party:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                for top in {n.split(".")[0] for n in names} - first_party - set(sys.stdlib_module_names):
                    dists = {d.lower().replace("_", "-") for d in distributions.get(top, [top])}
                    if not dists & declared:
                        missing.setdefault(top, set()).add(str(path.relative_to(REPO)))
    assert not missing, f"imported but not declared in setup.py: {missing}"


# Layers, bottom up: a package imports only packages below it (benchmarks and tests sit above all of them).
LAYERS = ["compat", "parallel", "converters", "models", "mcore_rl"]


def test_imports_run_one_way():
    import ast

    upward = []
    for level, package in enumerate(LAYERS):
        above = set(LAYERS[level + 1 :])
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                upward += [f"{path.relative_to(REPO)} imports {n}" for n in names if n.split(".")[0] in above]
    assert not upward, upward
