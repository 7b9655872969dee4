#!/usr/bin/env bash
# The one GPU check: install what the device lacks, run the whole suite (GPU tests included)
# and the benchmarks, and print a short summary last.
#
# On the device:  bash tools/gpu_check.sh [STAGE...]   (carry .whl; results land in $OUT, else ./.device-out)
#   STAGE: tests (the whole suite, fast path), tests1 and tests2 (every other test each, by
#   CUPROC_TEST_SHARD=1/2 and 2/2 (tests/conftest.py), for a device call too short for the whole suite:
#   on a slow machine it took 8 of the 10 minutes one call may run), pure (the GPU files on the pure
#   path), bench (every benchmark), benchpure (the launch, call and memory benchmarks once more on the
#   pure path, into pure/: the pure path must stay
#   default-capable, and before 2026-11-28 no check measured it), summary; none given: tests, pure,
#   bench, benchpure, summary.  The stages keep their logs in
#   $GPU_CHECK_STATE (default /tmp/cuproc-gpu-check), so that a device call with a time limit can run
#   one or two of them and a later call on the same machine the rest; "summary" reads what the
#   earlier ones left (the two halves' counts added up, when the whole suite did not run).  A test
#   stage (tests, or tests1) begins a check: it clears what pure, bench and summary left before.
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/.device-out}
STATE=${GPU_CHECK_STATE:-/tmp/cuproc-gpu-check}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests pure bench benchpure summary)
mkdir -p "$FINAL" "$STATE"
pack() { tar -C "$STATE" -czf "$FINAL/gpu_check.tar.gz" .; }   # after each stage: a timeout keeps what ran
# What the test stages ran: the sources' digest (not the built module, caches or results)
tree_digest() { find cuproc tests tools -type f \( -name '*.py' -o -name '*.c' -o -name '*.sh' \) -print0 | sort -z \
                  | xargs -0 cat | md5sum | cut -c1-12; }
if ! python3 -c "import cffi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$STATE/gpu.txt"
# The optional compiled fast path, built in place (what pip install does); a failure leaves the pure path.
if [ ! -f "$STATE/fastpath.txt" ] || [ "${stages[0]}" = tests ] || [ "${stages[0]}" = tests1 ]; then
  python3 tools/build_fastpath.py > "$STATE/build_fastpath.log" 2>&1 || echo "fast path not built: see build_fastpath.log"
  python3 -c "import cuproc.fastpath as f; print(f.status())" 2>&1 | tail -1 > "$STATE/fastpath.txt"
fi
echo "fast path: $(cat "$STATE/fastpath.txt")"
# A check begins with its test stage (tests, or tests1): what every stage left from an earlier check on
# this machine goes, so that summary and bench never print an old run's results as this one's.
begin_check() { rm -f "$STATE"/pytest.log "$STATE"/pytest.rc "$STATE"/pytest_tests[12].* "$STATE"/pytest_pure.* \
                      "$STATE"/bench_* "$STATE"/summary.txt; rm -rf "$STATE"/pure; }
for stage in "${stages[@]}"; do
  case $stage in
    tests)
      begin_check
      CUPROC_MATRIX_REPORT=$STATE/matrix_mismatches.jsonl timeout 540 python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$STATE/pytest.log"
      echo "${PIPESTATUS[0]}" > "$STATE/pytest.rc" ;;
    tests1|tests2)   # every other test each (shards by test, not by file: a new file cannot unbalance them)
      # never an earlier run's counts: tests1 (run it first) begins the check, tests2 clears what it
      # replaces; each half notes the tree it ran on, and summary says when the two differ
      if [ "$stage" = tests1 ]; then begin_check; else rm -f "$STATE/pytest.log" "$STATE/pytest.rc" "$STATE"/pytest_tests2.*; fi
      tree_digest > "$STATE/pytest_$stage.tree"
      CUPROC_TEST_SHARD=${stage#tests}/2 CUPROC_MATRIX_REPORT=$STATE/matrix_mismatches.jsonl timeout 540 \
        python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$STATE/pytest_$stage.log"
      echo "${PIPESTATUS[0]}" > "$STATE/pytest_$stage.rc" ;;
    pure)   # the GPU files once more on the pure path (the CPU suite reruns its driver/launch/ownership tests itself)
      CUPROC_PURE_PYTHON=1 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_*.py 2>&1 | tee "$STATE/pytest_pure.log"
      echo "${PIPESTATUS[0]}" > "$STATE/pytest_pure.rc" ;;
    bench)
      rm -f "$STATE"/bench_*   # a benchmark that fails leaves no earlier run's table to be printed
      python3 -m cuproc.tools.dump_symbols --json > "$STATE/dump_symbols.json" 2> "$STATE/dump_symbols.err"
      python3 -m cuproc.tools.dump_symbols 'cuCtxCreate*' 'cuMemcpyHtoD*' 'cuLaunchKernel*' | head -8
      for b in benchmarks/bench_*.py; do
        timeout 240 python3 "$b" --out "$STATE" > "$STATE/$(basename "$b" .py).log" 2>&1 || echo "benchmark $b failed: see $(basename "$b" .py).log"
        pack
      done
      cat "$STATE"/bench_*.md 2>/dev/null ;;
    benchpure)
      rm -rf "$STATE/pure"; mkdir -p "$STATE/pure"
      for b in benchmarks/bench_launch.py benchmarks/bench_driver.py benchmarks/bench_memory.py; do
        CUPROC_PURE_PYTHON=1 timeout 240 python3 "$b" --out "$STATE/pure" > "$STATE/pure/$(basename "$b" .py).log" 2>&1 \
          || echo "benchmark $b (pure path) failed: see pure/$(basename "$b" .py).log"
        pack
      done
      grep -h -e '^# ' -e '^- \[' "$STATE"/pure/bench_*.md 2>/dev/null ;;
    summary)
      # pytest's own result line (other libraries may print at interpreter exit after it): "not run"
      # without a log, "no result line" with one that has none (killed by a time limit, or crashed)
      result() { python3 tools/add_pytest_counts.py --line "$1"; }
      rc() { cat "$1" 2>/dev/null || echo "none"; }
      suite=$(result "$STATE/pytest.log"); suite_rc=$(rc "$STATE/pytest.rc")
      if [ "$suite" = "not run" ] && { [ -f "$STATE/pytest_tests1.log" ] || [ -f "$STATE/pytest_tests2.log" ]; }; then
        # the two halves, added up (a half without a result line is named in the line)
        suite=$(python3 tools/add_pytest_counts.py --shards "$(result "$STATE/pytest_tests1.log")" "$(result "$STATE/pytest_tests2.log")")
        suite_rc="$(rc "$STATE/pytest_tests1.rc")/$(rc "$STATE/pytest_tests2.rc")"
        if [ -f "$STATE/pytest_tests1.tree" ] && [ -f "$STATE/pytest_tests2.tree" ] \
           && ! cmp -s "$STATE/pytest_tests1.tree" "$STATE/pytest_tests2.tree"; then
          suite="$suite [the halves ran on different source trees]"
        fi
      fi
      # each benchmark folder's goals, counted from its results files, and each benchmark that left a log
      # and no results named as failed ("not run" with neither)
      goals() {
        local dir=$1 log md failed=() files=0 met=0 missed=0 unread=0
        for log in "$dir"/bench_*.log; do
          [ -e "$log" ] && [ ! -e "${log%.log}.md" ] && failed+=("$(basename "$log" .log)")
        done
        for md in "$dir"/bench_*.md; do
          [ -e "$md" ] || continue
          files=$((files + 1))
          met=$((met + $(grep -c '^- \[met\]' "$md"))); missed=$((missed + $(grep -c '^- \[MISSED\]' "$md")))
          unread=$((unread + $(grep -c '^- \[not evaluated' "$md")))
        done
        if [ "$files" -eq 0 ] && [ ${#failed[@]} -eq 0 ]; then echo "not run"; return; fi
        local text="$met met, $missed missed, $unread not evaluated in $files files"
        [ ${#failed[@]} -eq 0 ] || text="$text; FAILED: ${failed[*]}"
        echo "$text"
      }
      # the GPU files skip themselves where no driver opens: on the GPU machine that is a failure of the check,
      # named here (pytest's -ra lists each skip's reason), never a pass with skips
      nodriver=$(grep -l 'no CUDA driver on this machine' "$STATE"/pytest*.log 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')
      summary="SUMMARY: $suite on $(head -1 "$STATE/gpu.txt") (pytest rc=$suite_rc); pure-path GPU pass: $(result "$STATE/pytest_pure.log") (rc=$(rc "$STATE/pytest_pure.rc")); fast path $(cat "$STATE/fastpath.txt"); benchmark goals: $(goals "$STATE"), pure path $(goals "$STATE/pure")"
      [ -z "$nodriver" ] || summary="$summary; GPU TESTS SKIPPED, no driver opened: ${nodriver% }"
      echo "$summary" > "$STATE/summary.txt"
      echo "$summary" ;;
    *) echo "gpu_check: unknown stage '$stage' (tests, tests1, tests2, pure, bench, benchpure, summary)"; exit 2 ;;
  esac
  pack
done
