#!/usr/bin/env bash
# One device session's whole work, started by a single `run` call (docs/gpu.md, "A session with a device"):
#
#   bash bench/gpu_session.sh                # on the device, with carry [".whl"]: every part in GPU_SESSION_SECONDS
#   GPU_SESSION_SECONDS=240 bash bench/gpu_session.sh --parts "2 3"   # a rerun of some parts (part 0 always runs)
#   bash bench/gpu_session.sh --cpu          # the same steps, small, on a CPU (tests/test_gpu_session.py)
#
# Parts, in this order, each under its own time limit, each recorded in $OUT as it ends (a timeout keeps the rest):
#   0  the carried wheels (.whl, bench/gpu_wheels.py) installed into a --target folder on PYTHONPATH; what is imported
#      from where; the GPU, and whether a second process may use it
#   1  bench/gpu.py at Qwen-14B-Chat's shape, through bench/gpu_session_bench.py (the same rows, written as they come),
#      with 16 queries (one batch of the recipe's 16) instead of 100; the rest as the blog recipe
#   2  train/sft.py end to end: recipe=blog model=tiny, then a random model of Qwen-14B-Chat's shape (GPU_SESSION_LAYERS
#      of its 40 layers) saved to a folder: 4 LoRA steps, ProbDiff on 8 queries, 128 new tokens, the peak memory of
#      its training steps and of its evaluations (bench/gpu_session_train.py)
#   3  the same with probdiff.async_eval=true probdiff.evaluator_gpus=<the GPU>, where the GPU allows a second process
# $OUT (at most 8 files come back): summary.md, summary.json, 0-env.log, 1-bench.md, 1-bench.log, 2-train.log,
# 3-async.log, tracebacks.txt. Every run passes report_to=none: the device has neither network nor wandb.
set -u

MODE=gpu
PARTS="1 2 3"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --parts) PARTS="$2"; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "usage: bash bench/gpu_session.sh [--cpu] [--parts \"1 2 3\"]" >&2; exit 2 ;;
  esac
  shift
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 1
OUT=${OUT:-$REPO/bench/results/session}
WORK=${GPU_SESSION_WORK:-/tmp/gpu_session}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export PROBDIFF_CACHE=${PROBDIFF_CACHE:-$WORK/cache}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
REPORT="$PY bench/gpu_session_report.py"
SECONDS=0

# Per part: its own limit; what a part leaves unused goes to the parts after it (all within TOTAL)
if [ "$MODE" = gpu ]; then
  TOTAL=${GPU_SESSION_SECONDS:-500}
  declare -A CAP=([0]=40 [1]=230 [2a]=60 [2b]=100 [3]=70)
  LAYERS=${GPU_SESSION_LAYERS:-8}
  SHAPE=qwen-14b
  BENCH_ARGS="--queries 16"
  TINY_ARGS=""
  # the issue's sizes: 4 LoRA steps (of the recipe's 16 sequences), ProbDiff on 8 queries, 128 new tokens
  SHAPED_ARGS="max_eval_samples=8 per_device_eval_batch_size=4 probdiff.n_queries=8 probdiff.max_new_tokens=128 probdiff.batch_size=8"
else
  TOTAL=${GPU_SESSION_SECONDS:-1200}
  declare -A CAP=([0]=120 [1]=240 [2a]=240 [2b]=300 [3]=300)
  LAYERS=${GPU_SESSION_LAYERS:-2}
  SHAPE=tiny
  BENCH_ARGS="--shape tiny --device cpu --queries 2 --max-new-tokens 3 --batch-size 2 --decode-batch 1 2 --train-tokens 32 --paths ours generate generate-static"
  TINY_ARGS="max_steps=2 eval_steps=1 save_steps=1 max_eval_samples=2 per_device_eval_batch_size=2 probdiff.n_queries=2 probdiff.batch_size=2 probdiff.max_new_tokens=4"
  SHAPED_ARGS="dtype=float32 bf16=false activation_checkpointing=false gradient_accumulation_steps=2 max_length=256 max_eval_samples=2 per_device_eval_batch_size=2 probdiff.n_queries=2 probdiff.max_new_tokens=4 probdiff.batch_size=2"
fi
SHAPED_COMMON="max_steps=4 eval_steps=2 save_steps=2 logging_steps=1"

selected() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# the seconds part $1 may take: the time left less the caps of the selected parts after it (the caps scaled down to
# TOTAL where the selected ones add up to more)
limit_for() {
  local later=0 all=0 seen=0 part
  for part in 0 1 2a 2b 3; do
    if [ "$part" = 0 ] || selected "${part:0:1}"; then
      all=$((all + ${CAP[$part]}))
      [ "$seen" = 1 ] && later=$((later + ${CAP[$part]}))
    fi
    [ "$part" = "$1" ] && seen=1
  done
  [ "$all" -gt "$TOTAL" ] && later=$((later * TOTAL / all))
  local left=$((TOTAL - SECONDS - later))
  [ "$left" -lt 10 ] && left=10
  echo "$left"
}

# what is left of LIMIT since STARTED (at least 10 s)
rest_of() { local left=$(($1 - (SECONDS - $2))); [ "$left" -lt 10 ] && left=10; echo "$left"; }

# run LIMIT LOG COMMAND...: the command under timeout, its output appended to LOG; sets RC and TOOK
run_logged() {
  local limit=$1 log=$2; shift 2
  local started=$SECONDS
  echo "== $(date +%H:%M:%S) (limit ${limit}s): $*" >>"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  RC=$?
  TOOK=$((SECONDS - started))
  echo "== exit $RC after ${TOOK}s" >>"$log"
}

echo "bench/gpu_session.sh: $MODE mode, parts 0 $PARTS, ${TOTAL}s in all; results in $OUT, work in $WORK"

# ---- 0: the environment ----
LOG0="$OUT/0-env.log"
: >"$LOG0"
LIMIT=$(limit_for 0)
STARTED=$SECONDS
if [ "$MODE" = gpu ] || [ -n "${GPU_SESSION_WHEELS:-}" ]; then
  WHEELS=${GPU_SESSION_WHEELS:-$REPO/.whl}
  SITE="$WORK/site"
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    rm -rf "$SITE"
    run_logged "$LIMIT" "$LOG0" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE:$PYTHONPATH" GPU_SESSION_SITE="$SITE"
  else
    echo "no wheels in $WHEELS: the image's packages as they are (python bench/gpu_wheels.py fills .whl)" >>"$LOG0"
  fi
fi
{ nvidia-smi 2>&1 || echo "no nvidia-smi"; } >>"$LOG0"
run_logged "$(rest_of "$LIMIT" "$STARTED")" "$LOG0" $REPORT env --out "$OUT" --mode "$MODE"
echo "0-env: exit $RC after ${TOOK}s"

# ---- 1: the benchmark kit ----
if selected 1; then
  LIMIT=$(limit_for 1)
  run_logged "$LIMIT" "$OUT/1-bench.log" "$PY" bench/gpu_session_bench.py --md "$OUT/1-bench.md" \
    --json "$WORK/1-bench.json" --budget-s $((LIMIT - 20)) $BENCH_ARGS
  $REPORT part --out "$OUT" --name 1-bench --rc $RC --seconds $TOOK --limit "$LIMIT" --log "$OUT/1-bench.log" \
    --bench-json "$WORK/1-bench.json"
  echo "1-bench: exit $RC after ${TOOK}s"
fi

# ---- 2: train/sft.py end to end ----
MODEL="$WORK/model-$SHAPE-$LAYERS"
make_model() {  # LOG LIMIT: the random model of $SHAPE with $LAYERS layers, made once per machine
  if [ -f "$MODEL/config.json" ] && [ -f "$MODEL/probdiff_session_model.log" ]; then
    { echo "== the model made earlier: $MODEL"; cat "$MODEL/probdiff_session_model.log"; } >>"$1"
    RC=0
    return
  fi
  rm -rf "$MODEL"
  run_logged "$2" "$1" "$PY" bench/gpu_session_train.py make-model "$MODEL" --shape "$SHAPE" --layers "$LAYERS"
  if [ "$RC" = 0 ]; then grep '^make-model: ' "$1" | tail -2 >"$MODEL/probdiff_session_model.log"; fi
}

if selected 2; then
  LOG2="$OUT/2-train.log"
  RUN="$WORK/runs/2-tiny"
  rm -rf "$RUN"
  LIMIT=$(limit_for 2a)
  run_logged "$LIMIT" "$LOG2" "$PY" train/sft.py recipe=blog model=tiny report_to=none output_dir="$RUN" $TINY_ARGS
  $REPORT part --out "$OUT" --name 2-train-tiny --rc $RC --seconds $TOOK --limit "$LIMIT" --log "$LOG2" \
    --run-dir "$RUN"
  echo "2-train-tiny: exit $RC after ${TOOK}s"

  STARTED=$SECONDS
  LIMIT=$(limit_for 2b)
  make_model "$LOG2" "$LIMIT"
  RUN="$WORK/runs/2-shaped"
  rm -rf "$RUN" "$WORK/memory-2.jsonl"
  if [ "$RC" = 0 ]; then
    run_logged "$(rest_of "$LIMIT" "$STARTED")" "$LOG2" "$PY" bench/gpu_session_train.py train \
      --memory "$WORK/memory-2.jsonl" -- recipe=blog model="$MODEL" report_to=none output_dir="$RUN" \
      $SHAPED_COMMON $SHAPED_ARGS
  fi
  $REPORT part --out "$OUT" --name 2-train-qwen14b-shape --rc $RC --seconds $((SECONDS - STARTED)) --limit "$LIMIT" \
    --log "$LOG2" --run-dir "$RUN" --memory "$WORK/memory-2.jsonl" --model-log "$LOG2"
  echo "2-train-qwen14b-shape: exit $RC after $((SECONDS - STARTED))s"
fi

# ---- 3: the evaluation beside training ----
if selected 3; then
  LOG3="$OUT/3-async.log"
  : >>"$LOG3"
  WHY=$($PY bench/gpu_session_report.py second-process --out "$OUT" 2>&1)
  if [ "$WHY" != yes ]; then
    $REPORT skip --out "$OUT" --name 3-async --why "$WHY"
    echo "3-async: skipped: $WHY"
  else
    STARTED=$SECONDS
    LIMIT=$(limit_for 3)
    make_model "$LOG3" "$LIMIT"
    RUN="$WORK/runs/3-async"
    rm -rf "$RUN" "$WORK/memory-3.jsonl"
    if [ "$MODE" = gpu ]; then
      GPU=${CUDA_VISIBLE_DEVICES:-0}
      BESIDE="probdiff.async_eval=true probdiff.evaluator_gpus=${GPU%%,*}"
    else
      BESIDE="probdiff.async_eval=true threads=1 probdiff.evaluator_threads=1"
    fi
    if [ "$RC" = 0 ]; then
      run_logged "$(rest_of "$LIMIT" "$STARTED")" "$LOG3" "$PY" bench/gpu_session_train.py train \
        --memory "$WORK/memory-3.jsonl" -- recipe=blog model="$MODEL" report_to=none output_dir="$RUN" \
        $SHAPED_COMMON $SHAPED_ARGS $BESIDE
    fi
    for log in $(find "$RUN" -name evaluator.log 2>/dev/null); do
      { echo "== the evaluator's log: $log"; cat "$log"; } >>"$LOG3"
    done
    $REPORT part --out "$OUT" --name 3-async --rc $RC --seconds $((SECONDS - STARTED)) --limit "$LIMIT" \
      --log "$LOG3" --run-dir "$RUN" --memory "$WORK/memory-3.jsonl" --model-log "$LOG3"
    echo "3-async: exit $RC after $((SECONDS - STARTED))s"
  fi
fi

echo "bench/gpu_session.sh: done in ${SECONDS}s; $OUT/summary.md:"
cat "$OUT/summary.md"
$REPORT verdict --out "$OUT"
