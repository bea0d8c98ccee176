#!/usr/bin/env bash
# Store-host failover protocol (Note [Store-host failover]): the model test of
# tests/unit/failover_model_test.cpp over many more random schedules of
# crashes, partitions and heals than the suite runs. Argument: the number of
# random schedules (default 100000). Prints the counts and the run time.
set -euo pipefail
export DTRAIN_FAILOVER_SCHEDULES="${1:-100000}"
exec "$DTRAIN_BUILD/tests/dtrain_unit_tests" --gtest_filter='FailoverModel.*'
