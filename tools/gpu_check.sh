#!/usr/bin/env bash
# The one prepared script for a lent GPU (an H200, 15 minutes of device time in all: one run plus a rerun).
#
#   1. versions; 2. the kernel tests compiled for CUDA (tests/test_kernels.py, no TRITON_INTERPRET);
#   3. the decode-step kernel benchmark (tools/bench_decode.py, 8B-shaped layer, 32K tokens);
#   4. the main job on an 8B-shaped random bf16 model at 32K tokens (tools/make_shape_model.py llama-3.1-8b,
#      then tools/gpu_main_job.py: each method's build over prefill, peak GPU memory, load GB/s, decode ratio).
# Everything lands in one Markdown file, $OUT/gpu_check.md (logs beside it); OUT defaults to bench-out/.
#
# On this workplace's H200 (device tool), from the repo root:
#     run(command="bash tools/gpu_check.sh", carry=["runs/whl"], timeout_s=560)
# runs/whl holds the wheels the machine lacks or has in other versions (transformers 5.23, zstandard,
# huggingface_hub, tokenizers for Python 3.12), made here with
#     python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d runs/whl transformers==5.23.0 zstandard==0.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3
# Each stage has its own timeout (tests 120 s, benchmark 90 s, model 120 s, main job 200 s, at most 530 s in all;
# the main job builds no further method after 120 s) so the file is written even when one of them runs long. Scratch (the 16 GB model folder, the .kvpack files) goes to
# $KVPACK_TMP (default /tmp/kvpack-gpu), never to $OUT.
#
#     bash tools/gpu_check.sh --dry-run    # CPU, seconds: the same stages on the reference model (tests/test_gpu_check.py)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-bench-out}
SCRATCH=${KVPACK_TMP:-/tmp/kvpack-gpu}
mkdir -p "$OUT_DIR" "$SCRATCH"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 KVPACK_TMP="$SCRATCH"
REPORT="$OUT_DIR/gpu_check.md"

if [ -d runs/whl ] && ls runs/whl/*.whl >/dev/null 2>&1 && [ "$DRY" -eq 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        runs/whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

if [ "$DRY" -eq 1 ]; then
    DEVICE=cpu
    export TRITON_INTERPRET=1
    TEST_ARGS=(--collect-only -q)
    BENCH_ARGS=(--device cpu --dtype float32 --tokens 256 --heads 4 --kv-heads 2 --head-dim 32 --reps 2 --warmup 1
                --no-reference)
    MODEL_ARGS=(--list)
    JOB_ARGS=(--tokens 48 --methods kvzip,streaming --steps 2 --chunk-size 32 --device cpu)
else
    DEVICE=cuda
    unset TRITON_INTERPRET
    TEST_ARGS=(-q -p no:cacheprovider)
    "$PY" -c "import xdist" 2>/dev/null && TEST_ARGS+=(-n 8)
    BENCH_ARGS=(--device cuda --tokens 32768 --reps 50)
    MODEL_ARGS=(llama-3.1-8b --out "$SCRATCH/llama-3.1-8b" --dtype bfloat16)
    JOB_ARGS=(--model "$SCRATCH/llama-3.1-8b" --tokens 32768 --steps 20 --device cuda --budget-s 120)
fi

# 1. versions; on a GPU run, fail fast without CUDA or triton
"$PY" - "$DEVICE" <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import platform, sys
device = sys.argv[1]
try:
    import torch, transformers
except Exception as e:
    sys.exit(f"error: torch/transformers not importable with {sys.executable}: {e}")
try:
    import triton
    tv = triton.__version__
except Exception as e:
    tv = f"not importable ({e})"
if device == "cuda" and not torch.cuda.is_available():
    sys.exit(f"error: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU")
gpu = (f"GPU {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)"
       if device == "cuda" else "CPU (dry run)")
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, triton {tv}, {gpu}")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2

# 2. kernel tests
timeout 120 "$PY" -m pytest "${TEST_ARGS[@]}" tests/test_kernels.py > "$OUT_DIR/test_kernels.log" 2>&1
tests_rc=$?
# 3. decode benchmark
timeout 90 "$PY" tools/bench_decode.py "${BENCH_ARGS[@]}" --out "$OUT_DIR" > "$OUT_DIR/bench_decode.log" 2>&1
bench_rc=$?
# 4. the main job on the 8B shape (dry run: the tool's list of shapes, then the reference model)
timeout 120 "$PY" tools/make_shape_model.py "${MODEL_ARGS[@]}" > "$OUT_DIR/make_shape_model.log" 2>&1
model_rc=$?
job_rc=1
if [ "$model_rc" -eq 0 ]; then
    timeout 200 "$PY" tools/gpu_main_job.py "${JOB_ARGS[@]}" --out "$OUT_DIR/main_job.md" > "$OUT_DIR/main_job.log" 2>&1
    job_rc=$?
fi

{
    echo "# GPU check ($( [ "$DRY" -eq 1 ] && echo 'dry run on CPU' || echo "$DEVICE" ), $(date -u +%FT%TZ))"
    echo
    cat "$OUT_DIR/env.txt"
    echo
    echo "Exit codes (124 = timed out): kernel tests $tests_rc, decode benchmark $bench_rc, shape model $model_rc, main job $job_rc"
    echo
    echo "## Kernel tests"
    echo
    echo '```'
    tail -n 15 "$OUT_DIR/test_kernels.log"
    echo '```'
    echo
    echo "## Decode step, one 8B-shaped layer"
    echo
    if [ -f "$OUT_DIR/bench_decode.md" ]; then cat "$OUT_DIR/bench_decode.md"; else echo '```'; tail -n 15 "$OUT_DIR/bench_decode.log"; echo '```'; fi
    echo
    echo "## Main job"
    echo
    if [ -f "$OUT_DIR/main_job.md" ]; then cat "$OUT_DIR/main_job.md"; else echo '```'; tail -n 15 "$OUT_DIR/make_shape_model.log" "$OUT_DIR/main_job.log" 2>/dev/null; echo '```'; fi
} > "$REPORT"
[ "$DRY" -eq 1 ] || rm -rf "$SCRATCH/llama-3.1-8b"
echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc, model rc=$model_rc, main job rc=$job_rc; report $REPORT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$model_rc" -eq 0 ] && [ "$job_rc" -eq 0 ]
