#!/usr/bin/env bash
# GPU check of kernels/: the kernel tests compiled for CUDA (no TRITON_INTERPRET), then the decode benchmark.
#
# On this workplace's H200 (device tool), from a session that has one, run from the repo root:
#     run(command="bash tools/gpu_check.sh", timeout_s=600)          # no `carry` needed
# The machine's own python3 already has torch, triton and pytest (KINDS.md); nothing is installed or
# downloaded. kernels/, tests/test_kernels.py and tools/ travel with the working tree. Results land in
# $OUT (5 files: env.txt, test_kernels.log, bench_decode.log, bench_decode.md, bench_decode.json), or in
# bench-out/ (git-ignored) when OUT is unset. Expected wall time: about 5 minutes (most of it Triton
# compiling the test and sweep variants). Elsewhere: PYTHON=/path/to/python bash tools/gpu_check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-bench-out}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

# 1. fail fast, print versions
"$PY" - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import platform, sys
try:
    import torch
except Exception as e:
    sys.exit(f"error: torch is not importable with {sys.executable}: {e}")
try:
    import triton
except Exception as e:
    sys.exit(f"error: triton is not importable with {sys.executable}: {e}")
if not torch.cuda.is_available():
    sys.exit(f"error: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU")
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, GPU {torch.cuda.get_device_name()} "
      f"({torch.cuda.get_device_properties(0).multi_processor_count} SMs)")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT_DIR/env.txt"

# 2. kernel tests on CUDA (pytest-xdist spreads the Triton compiles over the cores when it is installed)
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
timeout 240 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" tests/test_kernels.py 2>&1 | tee "$OUT_DIR/test_kernels.log"
tests_rc=${PIPESTATUS[0]}

# 3. decode benchmark: full-cache SDPA vs our kernel at 32K tokens, 8B-shaped layer, plus a config sweep
timeout 300 "$PY" tools/bench_decode.py --device cuda --tokens 32768 --sweep --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/bench_decode.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc (124 = timed out); results in $OUT_DIR"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
