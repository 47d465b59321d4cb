#!/usr/bin/env bash
# The README's test command: bootstrap the venv (idempotent), check formatting, run the whole suite.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$repo/scripts/setup_env.sh")"
cd "$repo"
"$venv/bin/ruff" format --check .
"$venv/bin/ruff" check .
# Two workers (one per core): the tests of the gloo rank pool in one (tests/conftest.py), the rest beside them. (A
# third worker gained nothing: the two keep the machine busy.)
exec "$venv/bin/python" -m pytest -p no:cacheprovider -n 2 --dist loadgroup "$@"
