#!/usr/bin/env bash
# Chaos soak (issue 15 item 5): three `dtrain run` nodes in network
# namespaces train examples/fashion_mnist with DDP and checkpoints while
# bench/chaos/chaos.py injects faults from a fixed seed (see its docstring).
# Needs root for namespaces, link cuts and the checkpoint tmpfs; without it
# those faults are not fired and the run says so. Arguments go to chaos.py
# (e.g. --faults 24 --seed 7; --seeds 1..20 --overlap for the overlapping-fault
# soak over many seeds; --ft for the fault-tolerant mode, chaos_ft.py: e.g.
# --ft --faults 24 --steps 6000, one `dtrain run --ft-replicas 4` of the GPT).
# DTRAIN_BENCH_QUICK=1: 6 faults, one of each kind.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
extra=()
if [ "${DTRAIN_BENCH_QUICK:-0}" = 1 ]; then extra=(--faults 6 --epochs 3); fi
exec "$DTRAIN_PYTHON" "$here/chaos.py" --build "$DTRAIN_BUILD" "${extra[@]}" "$@"
