#!/usr/bin/env bash
# GSPO on Qwen3-30B-A3B: 2 nodes x 8 GPUs (TP 2 + sequence parallel, experts over EP 8, full recompute).
# Launch settings live in scripts/configs/qwen3_30b_a3b_gspo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/qwen3_30b_a3b bash scripts/train_qwen3_30b_a3b_gspo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch qwen3_30b_a3b_gspo qwen3_30b_a3b "$@"
