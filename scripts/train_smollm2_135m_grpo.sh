#!/usr/bin/env bash
# GRPO on the embedded SmolLM2-135M-Instruct and the built-in arithmetic set: the main job (CPU fp32 by default; GPU
# when present). Extra args are dotted overrides, e.g. runtime_args.num_episode=10. Re-running resumes.
# Environment variables and --dry-run: see scripts/lib/launch.sh.
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
launch smollm2_135m_grpo embedded "$@"
