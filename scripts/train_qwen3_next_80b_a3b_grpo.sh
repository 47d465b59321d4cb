#!/usr/bin/env bash
# GRPO on Qwen3-Next (80B-A3B): 4 nodes x 8 GPUs (TP 2 x PP 2, EP 16, full recompute; rollout TP 4).
# Launch settings live in scripts/configs/qwen3_next_80b_a3b_grpo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/Qwen3-Next-80B-A3B-Instruct bash scripts/train_qwen3_next_80b_a3b_grpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch qwen3_next_80b_a3b_grpo qwen3_next_80b_a3b "$@"
