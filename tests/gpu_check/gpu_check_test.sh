#!/usr/bin/env bash
# scripts/gpu-check.sh where no GPU is visible (CUDA_VISIBLE_DEVICES hides
# any): it builds what the checks need in this build tree, reports every GPU
# check as skipped with its reason and nothing as failed, and exits 0; with
# DTRAIN_REQUIRE_GPU=1 the same run exits non-zero.
#   gpu_check_test.sh SOURCE_DIR BUILD_DIR PYTHON
set -uo pipefail
src="$1" build="$2" python="$3"
fail() { echo "gpu_check_test: $*" >&2; exit 1; }
run() { CUDA_VISIBLE_DEVICES="" DTRAIN_GPU_BUILD="$build" DTRAIN_GPU_PYTHON="$python" "$src/scripts/gpu-check.sh"; }

out="$(run 2>&1)"
rc=$?
echo "$out"
[ $rc = 0 ] || fail "exit $rc without a GPU, expected 0"
summary="$build/gpu-check-summary.txt"
[ -f "$summary" ] || fail "no summary at $summary"
grep -q '^PASS  build ' "$summary" || fail "the build is not reported as passed"
grep -q '^FAIL' "$summary" && fail "a check failed"
# Every check but the build is a SKIP that says why.
checks="$(grep -E '^(PASS|FAIL|SKIP) ' "$summary" | grep -v '^PASS  build ')"
[ "$(wc -l <<<"$checks")" -ge 9 ] || fail "expected at least 9 GPU checks, got: $checks"
while IFS= read -r line; do
  [[ "$line" =~ ^SKIP\ +[a-z0-9-]+\ +.+:\ .+ ]] || fail "not a skip with a reason: $line"
done <<<"$checks"
grep -q '^SKIP  gpu-tests .*needs 1 GPU(s), 0 visible' "$summary" || fail "gpu-tests: no 'needs 1 GPU(s), 0 visible'"

DTRAIN_REQUIRE_GPU=1 run >/dev/null 2>&1 && fail "DTRAIN_REQUIRE_GPU=1 exited 0 without a GPU"
echo "gpu_check_test: OK"
