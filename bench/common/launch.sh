# Sourced by bench/*/run.sh: launch_ranks N OUTFILE CMD... starts N ranks of
# CMD under the env contract on loopback (one OpenMP thread each), waits for
# all, and leaves rank 0's stdout in OUTFILE. Fails if any rank fails.
launch_ranks() {
  local n="$1" out="$2"
  shift 2
  local port pids=() rc=0
  port="$("$DTRAIN_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  for ((r = 0; r < n; r++)); do
    local dest=/dev/null
    [ "$r" -eq 0 ] && dest="$out"
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      OMP_NUM_THREADS=1 timeout 600 "$@" >"$dest" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}
