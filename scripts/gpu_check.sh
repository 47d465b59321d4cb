#!/usr/bin/env bash
# The GPU self-check (tests/gpu/checks.py): steps on one GPU, each in its own process under its own time limit,
# PASS, FAIL or SKIP (with the reason) each, and a summary line; exit status 1 when a step fails. Run it first on
# any new GPU machine, with the project's venv or with a machine's own Python that has a CUDA torch:
#
#   bash scripts/gpu_check.sh --command 1 [--report r1.json]    # the cheapest, most telling steps (< 10 min)
#   bash scripts/gpu_check.sh --command 2 [--report r2.json]    # training, checkpoint, sync, the engine
#   bash scripts/gpu_check.sh [--wheels DIR] [--report PATH] [STEP ...]
#
# --wheels DIR: install the wheels of DIR (scripts/gpu_wheels.sh fills it on a machine with a package index) into a
# temporary directory for this run only, without their dependencies: the machine's torch is left as it is, and a
# torch of another version than the project's is reported as a warning. MCORE_RL_PYTHON: the interpreter (default:
# .venv's, else python3). No step needs the network; steps whose packages are missing say which. On a machine
# without CUDA every step reports SKIP (CI checks that).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${MCORE_RL_PYTHON:-}"
if [[ -z "$python" ]]; then
  python=python3
  [[ -x "$repo/.venv/bin/python" ]] && python="$repo/.venv/bin/python"
fi
cd "$repo"
args=()
wheels=""
while (($#)); do
  case "$1" in
    --wheels) wheels="${2:?--wheels needs a directory}"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
site=""
if [[ -n "$wheels" ]]; then
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
  shopt -s nullglob
  found=("$wheels"/*.whl)
  (( ${#found[@]} )) || { echo "gpu_check: no wheels in $wheels (scripts/gpu_wheels.sh fills it)" >&2; exit 2; }
  "$python" -m pip install --quiet --no-index --no-deps --target "$site" "${found[@]}"
fi
export PYTHONPATH="$repo${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" -m tests.gpu.checks "${args[@]}"
