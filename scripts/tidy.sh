#!/usr/bin/env bash
# Runs clang-tidy (checks in .clang-tidy) over dtrain's own sources, two at a
# time; fails on any finding. Slow (~30 s a file against LibTorch's headers),
# so it is not part of scripts/test.sh; run it before changing many files.
# Extra arguments: files to check instead of all of src/ and tools/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[ -f "$DTRAIN_BUILD/compile_commands.json" ] || "$DTRAIN_ROOT/scripts/setup.sh"
cd "$DTRAIN_ROOT"
if (($#)); then files=("$@"); else mapfile -t files < <(git ls-files 'src/*.cpp' 'tools/*.cpp' | grep -v backend_nccl.cpp); fi
printf '%s\n' "${files[@]}" | xargs -P 2 -n 1 clang-tidy -p "$DTRAIN_BUILD" --quiet 2>&1 |
  grep -E '(warning|error):' | sort -u | tee /tmp/dtrain-tidy.$$ || true
if [ -s /tmp/dtrain-tidy.$$ ]; then rm -f /tmp/dtrain-tidy.$$; echo "[dtrain-tidy] findings above" >&2; exit 1; fi
rm -f /tmp/dtrain-tidy.$$
echo "[dtrain-tidy] ${#files[@]} files clean"
