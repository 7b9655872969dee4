#!/usr/bin/env bash
# The one GPU check: install what the device lacks, run the whole suite (GPU tests included)
# and the benchmarks, and print a short summary last.
# On the device:  bash tools/gpu_check.sh   (carry .whl; results land in $OUT, else ./.device-out)
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/.device-out}
OUT=$(mktemp -d)   # everything lands here, then one archive in $FINAL (the device returns few files)
mkdir -p "$FINAL"
pack() { tar -C "$OUT" -czf "$FINAL/gpu_check.tar.gz" .; }   # after each stage: a timeout keeps what ran
if ! python3 -c "import cffi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# The optional compiled fast path, built in place (what pip install does); a failure leaves the pure path.
python3 tools/build_fastpath.py > "$OUT/build_fastpath.log" 2>&1 || echo "fast path not built: see build_fastpath.log"
fastpath=$(python3 -c "import cuproc.fastpath as f; print(f.status())" 2>&1 | tail -1)
echo "fast path: $fastpath" | tee "$OUT/fastpath.txt"
CUPROC_MATRIX_REPORT=$OUT/matrix_mismatches.jsonl timeout 540 python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}
# The GPU files once more on the pure path (the CPU suite reruns its driver/launch/ownership tests itself).
CUPROC_PURE_PYTHON=1 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_*.py 2>&1 | tee "$OUT/pytest_pure.log"
pure_rc=${PIPESTATUS[0]}
pack
python3 -m cuproc.tools.dump_symbols --json > "$OUT/dump_symbols.json" 2> "$OUT/dump_symbols.err"
python3 -m cuproc.tools.dump_symbols 'cuCtxCreate*' 'cuMemcpyHtoD*' 'cuLaunchKernel*' | head -8
for b in benchmarks/bench_*.py; do timeout 240 python3 "$b" --out "$OUT" > "$OUT/$(basename "$b" .py).log" 2>&1 || echo "benchmark $b failed: see $OUT/$(basename "$b" .py).log"; pack; done
cat "$OUT"/bench_*.md 2>/dev/null
# pytest's own result line (other libraries may print at interpreter exit after it)
result() { grep -E '[0-9]+ (passed|failed|errors?)' "$1" | tail -1; }
summary="SUMMARY: $(result "$OUT/pytest.log") on $(head -1 "$OUT/gpu.txt") (pytest rc=$tests_rc); pure-path GPU pass: $(result "$OUT/pytest_pure.log") (rc=$pure_rc); fast path $fastpath"
echo "$summary" > "$OUT/summary.txt"
pack
echo "$summary"
