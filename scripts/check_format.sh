#!/usr/bin/env bash
# Fails (listing the files) when a tracked C++ file differs from what
# clang-format makes of it with the checked-in .clang-format. Fix: run
#   git ls-files '*.cpp' '*.h' ':!:third_party/**' | xargs clang-format -i
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bad=()
while IFS= read -r f; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done < <(git ls-files '*.cpp' '*.h' ':!:third_party/**')
if ((${#bad[@]})); then
  printf '[dtrain-format] not clang-formatted: %s\n' "${bad[@]}" >&2
  echo "[dtrain-format] fix with: git ls-files '*.cpp' '*.h' ':!:third_party/**' | xargs clang-format -i" >&2
  exit 1
fi
echo "[dtrain-format] $(git ls-files '*.cpp' '*.h' ':!:third_party/**' | wc -l) files clang-formatted"
