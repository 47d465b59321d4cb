#!/usr/bin/env bash
# GRPO on the embedded SmolLM2-135M-Instruct and the built-in arithmetic set (CPU fp32 by default; GPU when
# present). Extra args are dotted overrides, e.g. runtime_args.num_episode=10. Re-running resumes.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$repo/scripts/setup_env.sh")"
cd "$repo"
MCORE_RL_MODEL="$("$venv/bin/python" -c 'from converters.gguf2hf import default_model_dir; print(default_model_dir())')"
export MCORE_RL_MODEL
exec "$venv/bin/python" -m mcore_rl.train scripts/configs/smollm2_135m_grpo.yaml "$@"
