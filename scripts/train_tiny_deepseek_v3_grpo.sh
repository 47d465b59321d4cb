#!/usr/bin/env bash
# GRPO on a tiny random DeepSeek-V3-shaped model on CPU (expert parallel 2, packing on); see the config's header.
# Builds the model once under runs/models/; extra args are dotted overrides. Re-running resumes.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$repo/scripts/setup_env.sh")"
cd "$repo"
export MCORE_RL_MODEL="$repo/runs/models/tiny_deepseek_v3"
[[ -f "$MCORE_RL_MODEL/config.json" ]] || "$venv/bin/python" -m tests.tiny DeepseekV3ForCausalLM "$MCORE_RL_MODEL"
exec "$venv/bin/python" -m mcore_rl.train scripts/configs/tiny_deepseek_v3_grpo.yaml "$@"
