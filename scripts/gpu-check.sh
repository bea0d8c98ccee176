#!/usr/bin/env bash
# The GPU checks, in one command, on a machine with a GPU, a CUDA toolkit and
# a Python `torch` of the supported window (2.11 through 2.15) but no network:
# no apt, no pip, nothing fetched. Configures build-gpu/ against that torch
# (torch.utils.cmake_prefix_path), builds only what the checks need, runs
# each check that this machine's GPUs allow, and ends with a one-page summary
# (also written to build-gpu/gpu-check-summary.txt) of what passed, what
# failed, and what was skipped and why. See docs/gpu.md.
#
#   scripts/gpu-check.sh                 # exit 0 unless a check that ran failed
#   DTRAIN_REQUIRE_GPU=1 scripts/gpu-check.sh   # also fail when a check was skipped for want of a GPU
#
# DTRAIN_GPU_PYTHON picks the Python whose torch to build against (default:
# python3 if its torch is in the window, else scripts/setup.sh's venv);
# DTRAIN_GPU_BUILD the build tree (default ./build-gpu; an existing tree
# configured against the same torch is used as it is).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
say() { printf '[gpu-check] %s\n' "$*" >&2; }

# --- the torch to build against ---------------------------------------------
torch_facts() {  # "VERSION PREFIX CUDA_BUILD GPUS" of $1's torch, or nothing
  "$1" - <<'EOF' 2>/dev/null
import torch
v = torch.__version__.split("+")[0]
print(v, torch.utils.cmake_prefix_path, int(torch.version.cuda is not None), torch.cuda.device_count())
EOF
}
in_window() { [[ "$1" =~ ^2\.(1[1-5])\. ]]; }
PYTHON="" FACTS=""
for candidate in ${DTRAIN_GPU_PYTHON:-} python3 "$DTRAIN_CACHE/venv/bin/python"; do
  command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
  facts="$(torch_facts "$candidate")" || continue
  [ -n "$facts" ] || continue
  if in_window "${facts%% *}"; then PYTHON="$candidate" FACTS="$facts"; break; fi
  say "skipping $candidate: its torch ${facts%% *} is outside the supported window 2.11-2.15"
done
if [ -z "$PYTHON" ]; then
  say "no Python with a torch of 2.11 through 2.15 found (set DTRAIN_GPU_PYTHON)"
  exit 1
fi
read -r TORCH_VERSION TORCH_PREFIX TORCH_CUDA GPUS <<<"$FACTS"
BUILD="${DTRAIN_GPU_BUILD:-$DTRAIN_ROOT/build-gpu}"
SUMMARY="$BUILD/gpu-check-summary.txt"
LOGS="$BUILD/gpu-check-logs"
say "torch $TORCH_VERSION from $PYTHON (CUDA build: $TORCH_CUDA, GPUs visible: $GPUS)"

# --- results ----------------------------------------------------------------
declare -a RESULTS=()
failed=0 skipped_for_gpu=0
record() {  # STATUS NAME DETAIL
  RESULTS+=("$(printf '%-5s %-26s %s' "$1" "$2" "$3")")
  [ "$1" = FAIL ] && failed=1
  say "$1 $2: $3"
}
# check NAME NEED_GPUS DESCRIPTION -- COMMAND...: runs COMMAND (log under
# $LOGS/NAME.log) when this machine has NEED_GPUS GPUs, else skips.
check() {
  local name="$1" need="$2" what="$3"
  shift 4
  if [ -n "$BUILD_BROKEN" ]; then record SKIP "$name" "$what: not built ($BUILD_BROKEN)"; return; fi
  if ((GPUS < need)); then
    skipped_for_gpu=1
    record SKIP "$name" "$what: needs $need GPU(s), $GPUS visible${NO_GPU_WHY:+ ($NO_GPU_WHY)}"
    return
  fi
  local start=$SECONDS
  if (cd "$BUILD" && "$@") >"$LOGS/$name.log" 2>&1; then
    record PASS "$name" "$what ($((SECONDS - start)) s)"
  else
    record FAIL "$name" "$what: see $LOGS/$name.log"
  fi
}
NO_GPU_WHY=""
if [ "$TORCH_CUDA" != 1 ]; then
  NO_GPU_WHY="this torch is a CPU-only build"
elif ((GPUS == 0)); then
  NO_GPU_WHY="torch.cuda.device_count() is 0: no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them"
fi

# --- configure and build what the checks need --------------------------------
mkdir -p "$BUILD" "$LOGS"
BUILD_BROKEN=""
generator=(-G Ninja)
command -v ninja >/dev/null 2>&1 || generator=()
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  say "configuring $BUILD against $TORCH_PREFIX"
  cmake -S "$DTRAIN_ROOT" -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DDTRAIN_PYTHON="$PYTHON" -DDTRAIN_BUILD_BENCH=OFF \
    >"$LOGS/configure.log" 2>&1 || BUILD_BROKEN="configure failed: $LOGS/configure.log"
elif ! grep -q "^Torch_DIR:PATH=$TORCH_PREFIX/" "$BUILD/CMakeCache.txt"; then
  # An existing tree (scripts/test.sh's, say) is used as it is, never reconfigured.
  BUILD_BROKEN="$BUILD is configured against another torch ($(sed -n 's/^Torch_DIR:PATH=//p' "$BUILD/CMakeCache.txt")); remove it or set DTRAIN_GPU_BUILD"
fi
if [ -z "$BUILD_BROKEN" ]; then
  targets=(dtrain_tests_gpu gpt dtrain_cli)
  say "building ${targets[*]} (log: $LOGS/build.log)"
  cmake --build "$BUILD" --target "${targets[@]}" >"$LOGS/build.log" 2>&1 ||
    BUILD_BROKEN="build failed: $LOGS/build.log"
fi
[ -z "$BUILD_BROKEN" ] && record PASS build "configured and built against torch $TORCH_VERSION" ||
  record FAIL build "$BUILD_BROKEN"

# --- the checks ---------------------------------------------------------------
CORPUS="$DTRAIN_SHAKESPEARE_DIR"
[ -f "$CORPUS/meta.json" ] || CORPUS=""
GPT=(examples/gpt --max-iters 20 --eval-interval 10 --eval-iters 2 --sample-tokens 0)
RUN=(tools/dtrain run --nproc-per-node 2)
need_corpus() {  # the GPT checks train on the Shakespeare corpus (scripts/setup.sh makes it)
  if [ -z "$CORPUS" ]; then
    record SKIP "$1" "no Shakespeare corpus in $DTRAIN_SHAKESPEARE_DIR (copy it from a machine that ran setup.sh)"
    return 1
  fi
}
GPT+=(--data-dir "${CORPUS:-/nonexistent}")

check gpu-tests 1 "ctest -L gpu (device selection, NCCL collectives, P2P, AMP, loader, checkpoints)" -- \
  ctest -L gpu --no-tests=error --output-on-failure --timeout 600
if need_corpus gpt-single-bf16; then
  check gpt-single-bf16 1 "GPT on one GPU, bf16 autocast" -- "${GPT[@]}" --strategy single --devices cuda --amp bf16
fi
record SKIP gpt-single-fp16 "GPT on one GPU, fp16 + GradScaler: examples/gpt has no --amp fp16 yet (the GPU tests cover GradScaler on CUDA)"
if need_corpus gpt-checkpoint-resume; then
  check gpt-checkpoint-resume 1 "GPT on one GPU stops and resumes from a checkpoint (CUDA generator state)" -- \
    bash -c "rm -rf ckpt-gpu && ${GPT[*]} --strategy single --devices cuda --dropout 0.1 --max-iters 10 --checkpoint-dir ckpt-gpu \
      && ${GPT[*]} --strategy single --devices cuda --dropout 0.1 --checkpoint-dir ckpt-gpu 2>&1 | grep -q 'resumed at step 10'"
fi
if need_corpus gpt-dp; then
  check gpt-dp 1 "GPT with DataParallel over the GPUs there are" -- "${GPT[@]}" --strategy dp --devices all
fi
if need_corpus gpt-model-parallel; then
  check gpt-model-parallel 1 "GPT split over the GPUs there are (model parallel)" -- \
    "${GPT[@]}" --strategy model-parallel --devices all
fi
for strategy in ddp zero3 pipeline; do
  if need_corpus "gpt-$strategy-nccl"; then
    check "gpt-$strategy-nccl" 2 "GPT --strategy $strategy, 2 processes over NCCL" -- \
      "${RUN[@]}" "${GPT[@]}" --strategy "$strategy" --devices cuda
  fi
done
if ((GPUS == 1)); then
  check gloo-cuda-one-gpu 1 "DDP, ZeRO-3 and the pipeline over Gloo with CUDA tensors, 2 processes on one GPU" -- \
    ctest -L gpu -R GlooCuda --no-tests=error --output-on-failure --timeout 600
else
  ((GPUS == 0)) && skipped_for_gpu=1
  record SKIP gloo-cuda-one-gpu "Gloo with CUDA tensors on one shared GPU: runs where exactly 1 GPU is visible ($GPUS)"
fi

# --- summary --------------------------------------------------------------------
{
  echo "dtrain GPU check, $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
  echo "torch $TORCH_VERSION ($PYTHON), CUDA build: $TORCH_CUDA, GPUs visible: $GPUS"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | sed 's/^/  /'
  echo
  printf '%s\n' "${RESULTS[@]}"
  echo
  echo "logs: $LOGS"
} | tee "$SUMMARY"
if ((failed)); then exit 1; fi
if [ "${DTRAIN_REQUIRE_GPU:-0}" = 1 ] && ((skipped_for_gpu)); then
  say "DTRAIN_REQUIRE_GPU=1 and checks were skipped for want of a GPU"
  exit 1
fi
exit 0
