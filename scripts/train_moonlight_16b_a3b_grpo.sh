#!/usr/bin/env bash
# GRPO on Moonlight-16B-A3B (DeepSeek-V3 architecture): 1 node x 8 GPUs (experts over EP 8, full recompute).
# Launch settings live in scripts/configs/moonlight_16b_a3b_grpo.yaml; the architecture comes from the model's config.json.
# Environment variables (MODEL_DIR, DATA, NNODES, GPUS_PER_NODE, RAY_ADDRESS, MCORE_DIR, OUTPUT_DIR) and
# --dry-run: see scripts/lib/launch.sh. Example: MODEL_DIR=/ckpt/moonlight_16b_a3b bash scripts/train_moonlight_16b_a3b_grpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch moonlight_16b_a3b_grpo moonlight_16b_a3b "$@"
