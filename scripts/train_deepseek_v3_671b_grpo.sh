#!/usr/bin/env bash
# GRPO on DeepSeek-V3 (671B): 32 nodes x 8 GPUs (TP 8 x PP 8, 5 layers on the last stage, EP 32, full recompute; rollout TP 32).
# Launch settings live in scripts/configs/deepseek_v3_671b_grpo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/deepseek_v3 bash scripts/train_deepseek_v3_671b_grpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch deepseek_v3_671b_grpo deepseek_v3 "$@"
