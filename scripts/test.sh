#!/usr/bin/env bash
# The README's test command: bootstrap the venv (idempotent), check formatting, run the whole suite.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$repo/scripts/setup_env.sh")"
cd "$repo"
"$venv/bin/ruff" format --check .
"$venv/bin/ruff" check .
# The two workers share the two cores with their ranks, engines and runs, so OpenMP threads that wait sleep at once
# (libgomp spins first, holding a core another process needs), and a process that sets no thread count of its own
# (the workers, the commands they run) uses one. Measured: a rank-pool module beside an end-to-end run took 203 s,
# 184 s with both.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two workers (one per core): the tests of the gloo rank pool in one (tests/conftest.py), the rest beside them. (A
# third worker gained nothing: the two keep the machine busy.)
exec "$venv/bin/python" -m pytest -p no:cacheprovider -n 2 --dist loadgroup "$@"
