#!/usr/bin/env bash
# GRPO on GLM-4.5 (355B-A32B): 16 nodes x 8 GPUs (TP 4 x PP 8, 8 layers on the last stage, EP 16, full recompute; rollout TP 16).
# Launch settings live in scripts/configs/glm45_355b_a32b_grpo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/GLM-4.5 bash scripts/train_glm45_355b_a32b_grpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch glm45_355b_a32b_grpo glm45_355b_a32b "$@"
