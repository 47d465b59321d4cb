#!/usr/bin/env bash
# GRPO on a tiny random DeepSeek-V3-shaped model on CPU (expert parallel 2, packing on); see the config's header.
# Builds the model once under runs/models/ (unless MODEL_DIR is set); extra args are dotted overrides. Re-running
# resumes. Environment variables and --dry-run: see scripts/lib/launch.sh.
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
export MODEL_DIR="${MODEL_DIR:-$repo/runs/models/tiny_deepseek_v3}"
if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  (cd "$repo" && "$(bash scripts/setup_env.sh)/bin/python" -m tests.tiny DeepseekV3ForCausalLM "$MODEL_DIR")
fi
launch tiny_deepseek_v3_grpo tiny_deepseek_v3 "$@"
