#!/usr/bin/env bash
# Every GPU number in the README, in one go: GPU tests, then each benchmark; results land in $RESULTS.
set -u
export PYTHONUNBUFFERED=1 RESULTS=${RESULTS:-benchmarks/results}
export OUT=$RESULTS
mkdir -p "$RESULTS"
run() { echo "=== $*"; timeout "$1" "${@:2}" 2>&1 | grep -v -E "Warning|warn\(|^\s*$" ; }
run 240 python3 -m pytest tests -q -m gpu -p no:cacheprovider
run 90 python3 benchmarks/profile_decode.py
run 200 python3 benchmarks/decode_roofline.py
run 150 python3 benchmarks/rollout.py
run 150 python3 benchmarks/sleep_wake.py
run 90 python3 benchmarks/weight_sync.py
run 150 python3 benchmarks/rl_step.py
