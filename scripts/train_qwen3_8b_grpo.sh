#!/usr/bin/env bash
# GRPO on Qwen3-8B: 1 node x 8 GPUs (trainer TP 2 + sequence parallel, DP 4, full recompute; eight rollout
# engines).
# Launch settings live in scripts/configs/qwen3_8b_grpo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/qwen3_8b bash scripts/train_qwen3_8b_grpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch qwen3_8b_grpo qwen3_8b "$@"
