#!/usr/bin/env bash
# GRPO on gpt-oss-120b: 8 nodes x 8 GPUs (TP 2 x PP 4, EP 16 without expert TP, full recompute; rollout TP 8).
# Launch settings live in scripts/configs/gpt_oss_120b_grpo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/gpt-oss-120b bash scripts/train_gpt_oss_120b_grpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch gpt_oss_120b_grpo gpt_oss_120b "$@"
