#!/usr/bin/env bash
# The prepared device check for a lent GPU machine (docs/gpu.md). In order, each step under
# `timeout`, a failed or timed-out step recorded and the next one run:
#   kernel-tests   the triton attention and fused-MoE kernel tests, compiled for CUDA
#   gpu-tests      pytest -m gpu tests/gpu (the engine on CUDA; backends, CUDA graphs)
#   random-model   a random-weight Llama-3.2-1B-shaped model in bf16, built locally
#   bench-decode   decode step time at batch 1..256 and prefill speed on that model
#   bench-nograph  the same at batch 1, 8, 64 with --disable-cuda-graph
# then writes OUT/gpu_check.json (GPU, each step's status and duration, the figures) and
# prints a table. Needs python with torch, triton, transformers and pytest; not Ray, not the
# network; radixray runs from this checkout through PYTHONPATH (nothing is installed).
#
# Usage: bash scripts/gpu_check.sh [--dry-run] [--out DIR] [--budget SECONDS] [--model-dir DIR]
#   --dry-run    no GPU needed: check the files and imports, build a tiny random model and
#                sweep it on the CPU, print the commands the check would run; exit 0 if fine
#   --out DIR    results and logs (default gpu_check_out)
#   --budget S   total seconds for the steps (default 465); later steps get what is left
#   --model-dir  where the 1B model goes (default $TMPDIR/radixray-gpu-check-llama-1b;
#                a complete earlier build there is reused)
# Environment: PYTHON (the interpreter; default: the first of the active venv, .venv,
# python3, python whose torch sees a GPU, else the first that imports torch);
# GPU_CHECK_WHEELS (a folder of wheels, pytest and its dependencies, installed into
# $TMPDIR/radixray-gpu-check-pydeps with --no-index when pytest is missing).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF=$REPO/scripts/gpu_check.sh
cd "$REPO" || exit 1
OUT=gpu_check_out
DRY=0
BUDGET=${GPU_CHECK_BUDGET_S:-465}
MODEL_DIR=${GPU_CHECK_MODEL_DIR:-${TMPDIR:-/tmp}/radixray-gpu-check-llama-1b}
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --out) OUT=$2; shift ;;
    --out=*) OUT=${1#--out=} ;;
    --budget) BUDGET=$2; shift ;;
    --model-dir) MODEL_DIR=$2; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
STEPS="kernel-tests gpu-tests random-model bench-decode bench-nograph"
for f in steps.tsv env.json gpu_check.json nvidia-smi.txt dry-run.log bench_decode.json \
         bench_nograph.json $(for s in $STEPS; do echo "$s.log"; done); do
  rm -f "${OUT:?}/$f"  # this check's own files, from an earlier run into the same folder
done

# ---- the interpreter and the environment --------------------------------------------------
pick_python() {  # $PYTHON; else the first candidate whose torch sees CUDA, else imports torch
  local c probe
  [ -n "${PYTHON:-}" ] && { echo "$PYTHON"; return 0; }
  for probe in "import torch; assert torch.cuda.is_available()" "import torch"; do
    for c in "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "$REPO/.venv/bin/python" \
             "$(command -v python3 || true)" "$(command -v python || true)"; do
      [ -n "$c" ] && [ -x "$c" ] && "$c" -c "$probe" >/dev/null 2>&1 && { echo "$c"; return 0; }
    done
  done
  return 1
}
PY=$(pick_python) || { echo "gpu_check.sh: no python that imports torch (set PYTHON)" >&2; exit 1; }
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

KERNEL_TESTS="tests/cpu/test_triton_attention.py tests/cpu/test_triton_moe.py"
SWEEP=scripts/gpu_decode_sweep.py
MAKE_MODEL=scripts/make_random_model.py
BATCHES=1,2,4,8,16,32,64,128,256

START=$(date +%s)
FAILED=0
DEADLINE=$((START + BUDGET))

record() {  # name status rc seconds limit command
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$OUT/steps.tsv"
}

run_step() {  # name cap_seconds reserve_seconds command...
  # The step gets at most cap seconds, and never the reserve the steps after it are promised.
  local name=$1 cap=$2 reserve=$3; shift 3
  local log="$OUT/$name.log" left limit t0 t1 rc status secs
  if [ "$DRY" = 1 ]; then
    printf '  %-14s timeout %3ss: %s\n' "$name" "$cap" "$*"
    record "$name" planned "" 0 "$cap" "$*"
    return 0
  fi
  left=$((DEADLINE - $(date +%s)))
  limit=$(( cap < left - reserve ? cap : left - reserve ))
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped (${left}s left of the ${BUDGET}s budget)" | tee "$log"
    record "$name" skipped "" 0 0 "$*"
    FAILED=$((FAILED + 1))
    return 0
  fi
  echo "== $name (limit ${limit}s): $*"
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  case $rc in
    0) status=pass ;;
    124|137) status=timeout ;;
    *) status=fail ;;
  esac
  echo "== $name: $status (rc $rc, ${secs}s)"
  [ "$status" = pass ] || FAILED=$((FAILED + 1))
  record "$name" "$status" "$rc" "$secs" "$limit" "$*"
}

report() {
  "$PY" "$SWEEP" report --out "$OUT" $([ "$DRY" = 1 ] && echo --dry-run)
}

# ---- the device and what is installed ----------------------------------------------------
echo "== radixray GPU check: python $PY, out $OUT, budget ${BUDGET}s$([ "$DRY" = 1 ] && echo ', DRY RUN')"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi.txt"
else
  echo "nvidia-smi: not found" | tee "$OUT/nvidia-smi.txt"
fi

if ! "$PY" -c "import pytest" >/dev/null 2>&1 && [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  PYDEPS=${TMPDIR:-/tmp}/radixray-gpu-check-pydeps
  echo "== pytest missing: installing it from $GPU_CHECK_WHEELS into $PYDEPS (no index)"
  "$PY" -m pip install -q --no-index --find-links "$GPU_CHECK_WHEELS" --target "$PYDEPS" \
    pytest && export PYTHONPATH="$PYTHONPATH:$PYDEPS"
fi

ENV_FLAGS=(--out "$OUT")
[ "$DRY" = 1 ] && ENV_FLAGS+=(--allow-no-cuda)
if ! "$PY" "$SWEEP" env "${ENV_FLAGS[@]}"; then
  echo "gpu_check.sh: preflight failed (above); nothing run" >&2
  record preflight fail 1 0 0 "$PY $SWEEP env"
  report
  exit 1
fi

# ---- the plan ------------------------------------------------------------------------------
# caps: 180 + 180 + 60 + 150 + 60 s; reserves keep 120 s for the GPU tests, 40 s for the
# model and 90 s for the benchmark whatever the steps before them took
steps() {
  run_step kernel-tests 180 250 env TRITON_INTERPRET=0 "$PY" -m pytest -q -ra \
    -p no:cacheprovider $KERNEL_TESTS
  run_step gpu-tests 180 130 env TRITON_INTERPRET=0 "$PY" -m pytest -v -ra -p no:cacheprovider \
    -o faulthandler_timeout=100 -m gpu tests/gpu
  run_step random-model 60 90 "$PY" $MAKE_MODEL --shape llama-1b --out "$MODEL_DIR" --reuse
  run_step bench-decode 150 0 env TRITON_INTERPRET=0 "$PY" $SWEEP run --model "$MODEL_DIR" \
    --device cuda --batch-sizes $BATCHES --prompt-len 128 --max-new-tokens 64 \
    --prefill-len 2048 --prefill-prompts 8 --label graphs-on --output "$OUT/bench_decode.json"
  run_step bench-nograph 60 0 env TRITON_INTERPRET=0 "$PY" $SWEEP run --model "$MODEL_DIR" \
    --device cuda --disable-cuda-graph --batch-sizes 1,8,64 --prompt-len 128 \
    --max-new-tokens 64 --prefill-prompts 0 --label graphs-off \
    --output "$OUT/bench_nograph.json"
}

if [ "$DRY" = 0 ]; then
  steps
  report
  echo "== done in $(( $(date +%s) - START ))s; $FAILED step(s) not passed"
  [ "$FAILED" = 0 ]
  exit
fi

# ---- --dry-run: the plan, and what can be checked without a GPU ---------------------------
echo "== plan (budget ${BUDGET}s in all; a step gets its timeout or what is left):"
steps
fail=0
check() {  # description command...
  local what=$1; shift
  if "$@" > "$OUT/dry-run.log" 2>&1; then
    echo "  ok    $what"
  else
    echo "  FAIL  $what"; sed 's/^/        /' "$OUT/dry-run.log" | tail -20; fail=1
  fi
}
echo "== dry-run checks:"
t0=$(date +%s)
for f in $KERNEL_TESTS tests/gpu/test_cuda_engine.py tests/gpu/test_gpu_backends.py $SWEEP \
         $MAKE_MODEL; do
  check "file $f" test -f "$f"
done
check "bash syntax of scripts/gpu_check.sh" bash -n "$SELF"
# what the lent machine lacks: Ray. Import the engine and collect the tests with it blocked.
NO_RAY_PROBE='
import importlib.abc, sys
class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("ray is blocked: the GPU check must not need it")
sys.meta_path.insert(0, NoRay())
import pytest, radixray.engine.engine, radixray.bench.roofline
rc = pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu"])
sys.exit(rc)
'
check "gpu tests collect, engine imports, without Ray" "$PY" -c "$NO_RAY_PROBE"
TINY=$(mktemp -d "${TMPDIR:-/tmp}/radixray-gpu-check-tiny.XXXXXX")
trap 'rm -rf "$TINY"' EXIT
check "random model --shape tiny" "$PY" $MAKE_MODEL --shape tiny --out "$TINY/model"
check "sweep on the tiny model (CPU)" "$PY" $SWEEP run --model "$TINY/model" --device cpu \
  --batch-sizes 1,2 --prompt-len 16 --max-new-tokens 4 --prefill-len 32 --prefill-prompts 2 \
  --label dry-run-cpu --output "$OUT/bench_decode.json"
record dry-run-checks "$([ "$fail" = 0 ] && echo pass || echo fail)" "$fail" \
  "$(( $(date +%s) - t0 ))" 0 "files, imports, tiny model, CPU sweep"
report
if [ "$fail" = 0 ]; then
  echo "== dry run ok in $(( $(date +%s) - START ))s"
else
  echo "== dry run FAILED" >&2
fi
exit "$fail"
