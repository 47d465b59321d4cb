#!/usr/bin/env bash
# GRPO on Qwen3.5 (397B-A17B): 32 nodes x 8 GPUs (TP 2 x PP 4, EP 64, full recompute; rollout TP 16).
# Launch settings live in scripts/configs/qwen3_5_397b_a17b_grpo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/Qwen3.5-397B-A17B-text bash scripts/train_qwen3_5_397b_a17b_grpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch qwen3_5_397b_a17b_grpo qwen3_5_397b_a17b "$@"
