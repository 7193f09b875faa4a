#!/usr/bin/env bash
# One GPU rollout host: vLLM + `legorl rollout-server`, one pair per group of GPUs.
#
#   scripts/launch_rollout_host.sh --config configs/qwen3_8b_v5p.yaml [--model DIR|gs://...]
#       [--instances N] [--base-port 50051] [--dry-run] [--insecure-no-auth] [--set k=v ...]
#
# Each instance is one `legorl rollout-server` that launches and supervises its
# own `vllm serve` (engine.kind=vllm): the server, not this script, owns the
# vLLM command line (rollout_server/backends/vllm.py adds the flags the token
# capture needs: processed logprobs, token ids, vLLM generation defaults, the
# dev-mode weight-reload endpoints and the path-reload worker extension) and
# restarts vLLM if it dies. This script prepares the host and splits the GPUs:
#
# - the model: a gs:// (or other tensorstore) path is downloaded once into
#   $LEGORL_MODEL_CACHE (default /var/cache/legorl/models); vLLM and the proxy
#   need a local HF directory;
# - the GPUs: instance i gets CUDA_VISIBLE_DEVICES = its tensor-parallel-size
#   GPUs (taken from engine.extra_args), gRPC port base+i, vLLM port 8000+i;
#   --instances defaults to all GPUs / tensor-parallel-size. List every
#   host:port it prints in the learner's fleet.servers;
# - nothing from a model hub: HF_HUB_OFFLINE=1;
# - the servers listen on every interface, so the config must name a bearer
#   token (fleet.security.token_env or token_file, e.g. --set
#   fleet.security.token_env=LEGORL_GRPC_TOKEN with that variable exported);
#   --insecure-no-auth waives that, for a network nobody else can reach.
#
# SIGTERM/SIGINT is passed to every server, which drains its trials (up to
# --drain-s, default 300 s) before stopping vLLM.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${LEGORL_PYTHON:-$ROOT/.venv/bin/python}"
CONFIG="" MODEL="" INSTANCES="" BASE_PORT=50051 ENGINE_PORT=8000 DRAIN_S=300 DRY_RUN=0
OVERRIDES=() INSECURE=()

die() { echo "launch_rollout_host: $*" >&2; exit 2; }

while (($#)); do
  case "$1" in
    --config) CONFIG="${2:?--config needs a file}"; shift 2 ;;
    --model) MODEL="${2:?--model needs a directory or URL}"; shift 2 ;;
    --instances) INSTANCES="${2:?--instances needs a number}"; shift 2 ;;
    --base-port) BASE_PORT="${2:?--base-port needs a port}"; shift 2 ;;
    --engine-port) ENGINE_PORT="${2:?--engine-port needs a port}"; shift 2 ;;
    --drain-s) DRAIN_S="${2:?--drain-s needs seconds}"; shift 2 ;;
    --set) OVERRIDES+=(--set "${2:?--set needs path=value}"); shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --insecure-no-auth) INSECURE=(--insecure-no-auth); shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[[ -n "$CONFIG" ]] || die "--config FILE is required"
[[ -f "$CONFIG" ]] || die "config $CONFIG not found"
[[ -x "$PYTHON" ]] || die "no Python at $PYTHON (run scripts/setup, or set LEGORL_PYTHON)"
for n in "$BASE_PORT" "$ENGINE_PORT" "$DRAIN_S" ${INSTANCES:+"$INSTANCES"}; do
  [[ "$n" =~ ^[0-9]+$ ]] || die "expected a whole number, got '$n'"
done

# Model path and tensor-parallel size, as the validated config sees them.
read -r CONFIG_MODEL TP SANDBOX TOKEN < <(
  "$PYTHON" - "$CONFIG" "${OVERRIDES[@]}" <<'EOF'
import sys
from legorl_jax.core.config import ConfigError, load_config
args = sys.argv[2:]
try:
    config = load_config(sys.argv[1], [args[i + 1] for i in range(0, len(args), 2)])
except ConfigError as exc:
    sys.exit(str(exc))
extra = config.engine.extra_args
tp = int(extra[extra.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in extra else 1
security = config.fleet.security
print(config.model.path or "-", tp, config.sandbox.kind, int(bool(security.token_env or security.token_file)))
EOF
) || die "config $CONFIG does not load (see above)"
if ((!TOKEN)) && ((${#INSECURE[@]} == 0)); then
  die "the servers listen on 0.0.0.0: set fleet.security.token_env or fleet.security.token_file" \
      "(e.g. --set fleet.security.token_env=LEGORL_GRPC_TOKEN), or pass --insecure-no-auth on a private network"
fi
MODEL="${MODEL:-$CONFIG_MODEL}"
[[ "$MODEL" != "-" ]] || die "no model: pass --model or set model.path in the config"

if command -v nvidia-smi >/dev/null; then
  GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
else
  ((DRY_RUN)) || die "nvidia-smi not found: this script is for GPU hosts"
  GPUS=${INSTANCES:-1}; GPUS=$((GPUS * TP))
fi
INSTANCES="${INSTANCES:-$((GPUS / TP))}"
((INSTANCES >= 1)) || die "$GPUS GPU(s) cannot hold one instance of tensor-parallel-size $TP"
((INSTANCES * TP <= GPUS)) || die "$INSTANCES instance(s) x $TP GPU(s) > $GPUS GPU(s) on this host"
if ((!DRY_RUN)); then
  command -v vllm >/dev/null || die "vllm not on PATH: install the vllm extra (pip install -e '.[vllm]')"
  if [[ "$SANDBOX" != "local" ]]; then
    docker info >/dev/null 2>&1 || die "no Docker daemon answers (sandbox.kind=$SANDBOX); start dockerd or use DOCKER_HOST"
  fi
fi

if [[ "$MODEL" == *://* && "$MODEL" != file://* ]]; then
  CACHE="${LEGORL_MODEL_CACHE:-/var/cache/legorl/models}"
  if ((DRY_RUN)); then
    echo "would download $MODEL into $CACHE"
  else
    echo "downloading $MODEL into $CACHE ..."
    # The same tensorstore download rollout servers use for published weights.
    MODEL=$("$PYTHON" -c 'import sys; from pathlib import Path; from rollout_server.weights import resolve_location
print(resolve_location(sys.argv[1], Path(sys.argv[2])))' "$MODEL" "$CACHE")
  fi
fi

export HF_HUB_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
PIDS=()
stop_all() { ((${#PIDS[@]})) && kill -TERM "${PIDS[@]}" 2>/dev/null; wait; }
trap stop_all TERM INT

for ((i = 0; i < INSTANCES; i++)); do
  DEVICES=$(seq -s, $((i * TP)) $((i * TP + TP - 1)))
  CMD=("$PYTHON" -m legorl_jax.cli rollout-server --config "$CONFIG" --model "$MODEL"
       --address "0.0.0.0:$((BASE_PORT + i))" --drain-s "$DRAIN_S" "${INSECURE[@]}" "${OVERRIDES[@]}"
       --set engine.kind=vllm --set "engine.port=$((ENGINE_PORT + i))")
  echo "instance $i: GPUs $DEVICES, gRPC $(hostname -f 2>/dev/null || hostname):$((BASE_PORT + i)), vLLM port $((ENGINE_PORT + i))"
  if ((DRY_RUN)); then
    echo "  CUDA_VISIBLE_DEVICES=$DEVICES ${CMD[*]}"
  else
    CUDA_VISIBLE_DEVICES="$DEVICES" "${CMD[@]}" &
    PIDS+=($!)
  fi
done
((DRY_RUN)) && exit 0
# One server exiting (vLLM could not start, a port is taken) stops the host:
# a supervisor (systemd, Kubernetes) restarts it whole rather than half of it.
set +e
wait -n
STATUS=$?
stop_all
exit "$STATUS"
