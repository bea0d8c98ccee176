#!/usr/bin/env bash
# The safetensors fuzz at bench size (issue 26): DTRAIN_FUZZ_COUNT cases
# (default 200,000; the suite runs 3,000) from DTRAIN_FUZZ_SEED (default 26,
# the suite's), each loaded memory-mapped and copied; any case that loads
# with bytes unaccounted for or fails otherwise than with a DataError naming
# the file stops the run (exit 1) and names its seed and index.
set -euo pipefail
"$DTRAIN_BUILD/bench/bench_safetensors_fuzz" --seed "${DTRAIN_FUZZ_SEED:-26}" --count "${DTRAIN_FUZZ_COUNT:-200000}"
