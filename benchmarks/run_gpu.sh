#!/usr/bin/env bash
# Every GPU number in the README, in one go: GPU tests, then each benchmark; results land in $RESULTS.
set -u
export PYTHONUNBUFFERED=1 RESULTS=${RESULTS:-benchmarks/results}
export OUT=$RESULTS
mkdir -p "$RESULTS"
run() { echo "=== ${*:2}"; timeout "$1" "${@:2}" 2>&1 | grep -v -E "Warning|warn\(|^\s*$"; }
run 150 python3 -m pytest tests -q -m gpu -p no:cacheprovider
run 120 python3 benchmarks/decode_roofline.py
run 100 python3 benchmarks/rollout.py
run 90 python3 benchmarks/sleep_wake.py
run 45 python3 benchmarks/weight_sync.py
run 80 python3 benchmarks/rl_step.py --steps 2
