#!/usr/bin/env bash
# Fill a wheel directory, on a machine with a package index, with what the GPU self-check needs on a GPU machine that
# has a CUDA torch and Python 3.12 but no network (the device machines lent to sessions): the cp312 manylinux x86-64
# wheels of the packages below, whose own dependencies that machine already has. Carry the directory there (it is
# ignored by git) and run: bash scripts/gpu_check.sh --wheels wheels/gpu --command 1
#
#   bash scripts/gpu_wheels.sh [DIR]          # default DIR: wheels/gpu; refuses past 16 MiB in all
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$repo/wheels/gpu}"
python="${MCORE_RL_PYTHON:-python3}"
[[ -x "$repo/.venv/bin/python" && -z "${MCORE_RL_PYTHON:-}" ]] && python="$repo/.venv/bin/python"
limit=$((16 << 20))
# What the self-check needs that the GPU image lacks (its torch, numpy and packaging are megatron-core's other
# requirements; transformers, safetensors, tokenizers, PyYAML and attrs are there too): megatron-core, and jsonschema
# (the run config's tool schemas) with its dependencies, the project's pins where it has them.
pin() { grep -m1 "^$1==" "$repo/requirements/common.txt" | cut -d' ' -f1; }
wheels=("$(pin megatron-core)" "$(pin jsonschema)" jsonschema-specifications referencing rpds-py)
mkdir -p "$dir"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --dest "$dir" "${wheels[@]}"
size=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
if (( size > limit )); then
  echo "gpu_wheels: $dir holds $((size >> 20)) MiB of wheels, past the 16 MiB that travels with a command" >&2
  exit 1
fi
echo "gpu_wheels: $(ls "$dir"/*.whl | wc -l) wheel(s), $((size >> 10)) KiB, in $dir"
