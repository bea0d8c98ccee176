#!/usr/bin/env bash
# Context parallelism (issue 25): the GPT (4 layers, 4 heads, width 128,
# sequences of 512, batch 4, AdamW) in one process against cp 2 on two
# processes (K/V ring, and all-gather), one OpenMP thread per process; the
# one-process run also with two threads (the machine's two cores). Tokens/s
# of the median step and the peak CPU tensor storage per rank
# (CpuMemoryStats). No Python peer: torch 2.15's context_parallel does not
# run on CPU (aten._scaled_dot_product_flash_attention_for_cpu has no
# sharding strategy).
# DTRAIN_BENCH_QUICK=1: fewer steps.
set -euo pipefail
steps=10
if [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ]; then steps=3; fi
bin="$DTRAIN_BUILD/bench/bench_cp"
run="$DTRAIN_BUILD/tools/dtrain run"
export OMP_NUM_THREADS=1
$run --nproc-per-node 1 "$bin" --cp 1 --steps "$steps"
OMP_NUM_THREADS=2 $run --nproc-per-node 1 "$bin" --cp 1 --threads 2 --steps "$steps"
$run --nproc-per-node 2 "$bin" --cp 2 --steps "$steps"
$run --nproc-per-node 2 "$bin" --cp 2 --exchange allgather --steps "$steps"
