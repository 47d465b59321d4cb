#!/usr/bin/env bash
# The README's test command: bootstrap the venv (idempotent), check formatting, run the whole suite.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$repo/scripts/setup_env.sh")"
cd "$repo"
"$venv/bin/ruff" format --check .
"$venv/bin/ruff" check .
# Three workers on two cores: the tests of the gloo rank pool in one (tests/conftest.py), the rest beside them. The
# multi-process tests wait (process start-ups, engines, Ray) much of their time: with two workers the machine was
# busy 56 % of a run (45 CPU-minutes in 40 minutes).
exec "$venv/bin/python" -m pytest -p no:cacheprovider -n 3 --dist loadgroup "$@"
