#!/usr/bin/env bash
# One check of the learner and the embedded engine on a lent NVIDIA machine
# (its image: JAX with CUDA, flax, optax, orbax, torch; no vLLM). Runs, each
# under its own time limit so the whole stays under 8 minutes:
#   learner  scripts/bench_learner.py in bf16 (MFU against the matmul peak measured in the same run)
#   attention scripts/bench_attention.py (cuDNN fused vs XLA: agreement and speed)
#   logprobs scripts/bench_logprobs.py --dtype bfloat16 (chunked vs naive peak memory)
#   engine   scripts/bench_engine.py (the embedded engine's decode against transformers)
# and writes one JSON report: every step's exit status, seconds, and output
# (the learner's own JSON parsed), with the GPU and JAX's devices.
#
#   scripts/device_check.sh [--dry-run] [REPORT.json]
#
# REPORT.json defaults to $OUT/device_check.json (the device runner's output
# folder), else ./device_check.json. --dry-run runs every step at toy shapes
# (toy vocabularies and widths too) on whatever JAX finds (CPU here), to check
# the script itself in CI's time.
set -uo pipefail

cd "$(dirname "$0")/.."
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
REPORT="${1:-${OUT:-.}/device_check.json}"
PY="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if (( DRY )); then
  LEARNER=(--size small --seq-len 128 --rows 1 --per-row 2 --dtype bfloat16 --matmul-n 256 --repeats 1 --chunk 64)
  ATTENTION=(--dry-run --seq 128 --batch 1 --repeat 1 --vocab 2048 --hidden 256)
  LOGPROBS=(--dtype bfloat16 --seq 128 --vocab 2048 --chunk 32)
  ENGINE=(--shape tiny --batches 1 --prompt-tokens 16 --new-tokens 4 --long-prompt 0 --first-turn 32 --turn-tokens 8)
  LIMITS=(600 600 600 600)  # generous: a shared CPU can be slow, and only the script is under test
else
  LEARNER=(--size 100m --seq-len 2048 --rows 8 --per-row 4 --dtype bfloat16 --matmul-n 8192 --repeats 3)
  ATTENTION=(--seq 4096 --batch 1 --repeat 10)
  LOGPROBS=(--dtype bfloat16 --grad)
  ENGINE=(--batches 1 8 32 --long-prompt 8192 --first-turn 4000 --turn-tokens 500)
  LIMITS=(130 70 70 170)
fi

run_step() {  # name limit_s command...: output and timing under $WORK/<name>.*
  local name="$1" limit="$2"; shift 2
  local start; start=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
  echo $? >"$WORK/$name.rc"
  echo $(( ($(date +%s%N) - start) / 1000000 )) >"$WORK/$name.ms"
  echo "device_check: $name exited $(cat "$WORK/$name.rc") after $(cat "$WORK/$name.ms") ms" >&2
}

run_step learner "${LIMITS[0]}" "$PY" scripts/bench_learner.py "${LEARNER[@]}" --out "$WORK/learner.json"
run_step attention "${LIMITS[1]}" "$PY" scripts/bench_attention.py "${ATTENTION[@]}"
run_step logprobs "${LIMITS[2]}" "$PY" scripts/bench_logprobs.py "${LOGPROBS[@]}"
run_step engine "${LIMITS[3]}" "$PY" scripts/bench_engine.py "${ENGINE[@]}"

"$PY" - "$WORK" "$REPORT" "$DRY" <<'EOF'
import json, pathlib, platform, subprocess, sys

work, report, dry = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3] == "1"
def read(name):
    path = work / name
    return path.read_text() if path.exists() else ""
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    gpu = ""
try:
    import jax
    devices = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
except Exception as exc:  # the report still says what ran
    devices = [f"jax failed: {exc!r}"]
steps = {}
for name in ("learner", "attention", "logprobs", "engine"):
    step = {"rc": int(read(f"{name}.rc") or -1), "seconds": int(read(f"{name}.ms") or 0) / 1000,
            "stdout": read(f"{name}.out")[-6000:], "stderr_tail": read(f"{name}.err")[-3000:]}
    if name == "learner" and read("learner.json"):
        step["report"] = json.loads(read("learner.json"))
        step.pop("stdout")
    steps[name] = step
out = {"dry_run": dry, "host": platform.node(), "gpu": gpu, "jax_devices": devices, "steps": steps,
       "ok": all(s["rc"] == 0 for s in steps.values())}
report.parent.mkdir(parents=True, exist_ok=True)
report.write_text(json.dumps(out, indent=2) + "\n")
print(f"device_check: report in {report}; every step passed: {out['ok']}", file=sys.stderr)
sys.exit(0 if out["ok"] else 1)
EOF
