#!/usr/bin/env bash
# A stopgap single-node launcher until `dtrain run` exists (issue #4):
#   scripts/launch_local.sh N PROGRAM [ARGS...]
# starts N ranks of PROGRAM on this machine under the env contract (RANK,
# WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free
# MASTER_PORT, OMP_NUM_THREADS=1 unless set). Rank 0's output passes through;
# other ranks' lines are prefixed "[rank R]" on stderr. If any rank fails,
# the others are stopped and its exit code is returned.
set -uo pipefail
n="${1:?usage: launch_local.sh N PROGRAM [ARGS...]}"
shift
[ "$#" -ge 1 ] || { echo "launch_local.sh: no program given" >&2; exit 2; }
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap 'cleanup; exit 130' INT TERM
for ((r = 0; r < n; r++)); do
  export RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  if [ "$r" -eq 0 ]; then
    "$@" &
  else
    "$@" > >(sed -u "s/^/[rank $r] /" >&2) 2>&1 &
  fi
  pids+=($!)
done
status=0
live=("${pids[@]}")
while [ "${#live[@]}" -gt 0 ]; do
  wait -n -p done_pid "${live[@]}"
  rc=$?
  next=()
  for p in "${live[@]}"; do [ "$p" = "$done_pid" ] || next+=("$p"); done
  live=("${next[@]}")
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
    echo "launch_local.sh: a rank (pid $done_pid) exited with $rc; stopping the others" >&2
    cleanup
  fi
done
exit "$status"
