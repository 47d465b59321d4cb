#!/usr/bin/env bash
# GRPO on Qwen3-235B-A22B: 8 nodes x 8 GPUs (TP 4 x PP 4, 22 layers on the last stage, EP 16, full recompute; rollout TP 8).
# Launch settings live in scripts/configs/qwen3_235b_a22b_grpo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/qwen3_235b_a22b bash scripts/train_qwen3_235b_a22b_grpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch qwen3_235b_a22b_grpo qwen3_235b_a22b "$@"
