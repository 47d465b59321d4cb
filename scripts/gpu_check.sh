#!/usr/bin/env bash
# The GPU self-check (tests/gpu/checks.py): seven steps on one GPU, PASS, FAIL or SKIP (with the reason) each, and a
# summary line; exit status 1 when a step fails. Run it first on any new GPU machine, with the project's venv or
# with a machine's own Python that has a CUDA torch, megatron-core and this repo (pip install --no-deps -e .):
#
#   bash scripts/gpu_check.sh [STEP ...]      # MCORE_RL_PYTHON: the interpreter (default: .venv's, else python3)
#
# No step needs the network; steps whose packages are missing say which. On a machine without CUDA every step
# reports SKIP (CI checks that).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${MCORE_RL_PYTHON:-}"
if [[ -z "$python" ]]; then
  python=python3
  [[ -x "$repo/.venv/bin/python" ]] && python="$repo/.venv/bin/python"
fi
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" -m tests.gpu.checks "$@"
