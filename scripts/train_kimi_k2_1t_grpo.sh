#!/usr/bin/env bash
# GRPO on Kimi-K2 (1T-A32B): 64 nodes x 8 GPUs (TP 8 x PP 8, 5 layers on the last stage, EP 64, full recompute; rollout TP 64).
# Launch settings live in scripts/configs/kimi_k2_1t_grpo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/Kimi-K2-Instruct bash scripts/train_kimi_k2_1t_grpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch kimi_k2_1t_grpo kimi_k2 "$@"
