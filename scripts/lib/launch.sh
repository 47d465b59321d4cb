# Shared by scripts/train_<model>.sh: environment variables -> one run of mcore_rl.train, or with --dry-run the
# full-size planner (meta tensors: the layout, the whole HF <-> Megatron mapping, the rollout sync and memory per
# device; any machine).
#
#   MODEL_DIR      HF checkpoint of the model (a real run needs it, except the embedded SmolLM2; --dry-run defaults
#                  to the public config.json under models/configs/, which is all the planner reads)
#   DATA           prompts JSONL (default: the config's data_path)
#   NNODES, GPUS_PER_NODE
#                  devices = NNODES x GPUS_PER_NODE (default: the config's runtime_args.num_devices)
#   RAY_ADDRESS    an existing Ray cluster for multi-node runs: `ray start --head --num-gpus 8` on the first node,
#                  `ray start --address HEAD:6379 --num-gpus 8` on the others, then run this script on the first;
#                  with token authentication on every node and here (README, "Network services"): the same
#                  ~/.ray/auth_token (`ray get-auth-token --generate` once) and RAY_AUTH_MODE=token exported
#   MCORE_DIR      train from a Megatron checkpoint instead of HF weights: converted from MODEL_DIR once (for the
#                  config's TP size) with mcore-rl-hf2mcore; the rollout engines still load MODEL_DIR
#   OUTPUT_DIR     run directory (default: the config's, runs/<exp_name>); re-running resumes from its checkpoints
#   DEVICE_MEMORY_GB
#                  GiB per GPU the layout must fit (default: the config's runtime_args.device_memory_gb, 80 for
#                  H100s); the run, and --dry-run, stop with what does not fit and layouts that would
#
# Further arguments are dotted config overrides (runtime_args.num_episode=10); with --dry-run, planner options too.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

launch() {
  local config="scripts/configs/$1.yaml" model="$2"
  shift 2
  local dry_run=0 args=()
  for arg in "$@"; do
    if [[ "$arg" == "--dry-run" ]]; then dry_run=1; else args+=("$arg"); fi
  done
  local venv
  venv="$(bash "$repo/scripts/setup_env.sh")"
  cd "$repo"
  if [[ -z "${MODEL_DIR:-}" && "$model" == "embedded" ]]; then
    MODEL_DIR="$("$venv/bin/python" -c 'from converters.gguf2hf import default_model_dir; print(default_model_dir())')"
  elif [[ -z "${MODEL_DIR:-}" ]]; then
    if ((dry_run)); then
      MODEL_DIR="$repo/models/configs/$model"
    else
      echo "error: set MODEL_DIR to the HF checkpoint of $model (or pass --dry-run to plan without weights)" >&2
      return 2
    fi
  fi
  export MCORE_RL_MODEL="$MODEL_DIR"
  local overrides=()
  [[ -n "${DATA:-}" ]] && overrides+=("runtime_args.data_path=$DATA")
  [[ -n "${OUTPUT_DIR:-}" ]] && overrides+=("runtime_args.output_dir=$OUTPUT_DIR")
  [[ -n "${RAY_ADDRESS:-}" ]] && overrides+=("runtime_args.ray_address=$RAY_ADDRESS")
  [[ -n "${DEVICE_MEMORY_GB:-}" ]] && overrides+=("runtime_args.device_memory_gb=$DEVICE_MEMORY_GB")
  if [[ -n "${NNODES:-}${GPUS_PER_NODE:-}" ]]; then
    overrides+=("runtime_args.num_devices=$((${NNODES:-1} * ${GPUS_PER_NODE:-8}))")
  fi
  if ((dry_run)); then
    exec "$venv/bin/python" -m mcore_rl.planner "$config" ${overrides[@]+"${overrides[@]}"} ${args[@]+"${args[@]}"}
  fi
  if [[ -n "${MCORE_DIR:-}" ]]; then
    if [[ ! -f "$MCORE_DIR/model/metadata.json" ]]; then
      local tp
      tp="$("$venv/bin/python" -c 'import sys
from mcore_rl.config.schema import load_run_config
print(load_run_config(sys.argv[1], sys.argv[2:]).models.policy_trainer.parallel.tp)' \
        "$config" ${overrides[@]+"${overrides[@]}"})"
      "$venv/bin/python" -m mcore_rl.convert hf2mcore "$MODEL_DIR" "$MCORE_DIR" --tp "$tp"
    fi
    overrides+=("models.policy_trainer.load=$MCORE_DIR" "models.ref_policy.load=$MCORE_DIR" "models.policy.load=$MODEL_DIR")
  fi
  exec "$venv/bin/python" -m mcore_rl.train "$config" ${overrides[@]+"${overrides[@]}"} ${args[@]+"${args[@]}"}
}
