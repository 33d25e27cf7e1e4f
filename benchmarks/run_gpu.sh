#!/usr/bin/env bash
# The GPU tests, then each benchmark the README's rows name, with the arguments they name (the `readme_*` steps:
# the rows run with other than the default arguments); results land in $RESULTS. The README's batch-1 decode
# rows came from an A/B probe of decode_roofline.run_shape; the `batch1` step measures the same steps.
# One device call allows 10 minutes, so pass the steps to run (default: all). Each step's exit status is
# printed; one that failed or ran out of time may have left a partial JSON.
set -u -o pipefail
export PYTHONUNBUFFERED=1 RESULTS=${RESULTS:-benchmarks/results}
export OUT=$RESULTS
mkdir -p "$RESULTS"
run() {
  echo "=== ${*:2}"
  timeout "$1" "${@:2}" 2>&1 | grep -v -E "UserWarning|FutureWarning|DeprecationWarning|warnings\.warn\(|^\s*$"
  local status=${PIPESTATUS[0]}
  if [ "$status" = 124 ]; then echo "=== TIMED OUT after $1 s: ${*:2}"; elif [ "$status" != 0 ]; then
    echo "=== FAILED (exit $status): ${*:2}"; fi
}
for step in ${@:-tests roofline compiled batch1 rollout sleep_wake weight_sync rl_step profile gemm spec profile_spec graph_gaps finite soak async server longtail longtail_8b fidelity invariant stream fp8 readme_rollout readme_long_prompts readme_fidelity readme_longtail readme_compiled}; do
  case $step in
    tests) run 400 python3 -m pytest tests -q -m gpu -p no:cacheprovider -rs ;;
    roofline) run 240 python3 benchmarks/decode_roofline.py ;;
    compiled) run 560 python3 benchmarks/compiled_baseline.py --models qwen3-1.7b  # about 2 min of compiling a shape
              run 560 python3 benchmarks/compiled_baseline.py --models llama-3.1-8b ;;
    rollout) run 150 python3 benchmarks/rollout.py ;;
    sleep_wake) run 100 python3 benchmarks/sleep_wake.py ;;
    weight_sync) run 150 python3 benchmarks/weight_sync.py ;;  # NCCL rows too on two GPUs
    rl_step) run 120 python3 benchmarks/rl_step.py ;;
    profile) run 90 python3 benchmarks/profile_decode.py ;;
    gemm) run 300 python3 benchmarks/decode_gemm_paths.py ;;  # the batch-1 kernel's tile sweep first
    batch1) run 300 python3 benchmarks/decode_roofline.py --cublas --quantization fp8 --batches 1 8 16 --contexts 1024 ;;
    spec) run 400 python3 benchmarks/spec_decode.py ;;
    profile_spec) run 200 python3 benchmarks/profile_spec.py ;;
    graph_gaps) run 100 python3 benchmarks/graph_gaps.py; run 60 python3 benchmarks/graph_gaps.py --toy ;;
    finite) run 100 python3 benchmarks/finite_check.py ;;
    soak) run 280 python3 benchmarks/soak.py --device cuda ;;
    async) run 290 python3 benchmarks/async_rollout.py ;;
    server) run 400 python3 benchmarks/server.py ;;  # needs the [server] extra's wheels (fastapi, opentelemetry-api, ...)
    longtail) run 560 python3 benchmarks/longtail_rollout.py --shape qwen3-1.7b ;;  # about 6 min a shape
    longtail_8b) run 560 python3 benchmarks/longtail_rollout.py --shape llama-3.1-8b ;;
    fidelity) run 400 python3 benchmarks/fidelity.py ;;
    invariant) run 300 python3 benchmarks/batch_invariant_cost.py
               run 300 python3 benchmarks/decode_roofline.py --batches 1 64 256 --contexts 1024 --batch-invariant ;;
    stream) run 300 python3 benchmarks/async_stream.py --shape qwen3-1.7b ;;
    # the fp8 rows: rollout.py / decode_roofline.py / weight_sync.py / fidelity.py --quantization fp8,
    # spec_decode.py --drafts aligned --ks 2 --batches 1 --draft-quantization fp8
    fp8) run 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8.py tests/test_fp8_shards.py
         run 200 python3 benchmarks/weight_sync.py --quantization fp8 --models llama-3.1-8b
         run 300 python3 benchmarks/decode_roofline.py --quantization fp8 --batches 1 64 256 --contexts 1024
         run 200 python3 benchmarks/rollout.py --quantization fp8 --fp8-kv --no-transformers
         run 200 python3 benchmarks/rollout.py --model llama-3.1-8b --prompts 32 --quantization fp8 --fp8-kv --no-transformers
         run 300 python3 benchmarks/spec_decode.py --drafts aligned --ks 2 --batches 1 --draft-quantization fp8
         run 400 python3 benchmarks/fidelity.py --quantization fp8 ;;
    readme_rollout) run 200 python3 benchmarks/rollout.py --fp8-kv --no-transformers
                    run 200 python3 benchmarks/rollout.py --fp8-kv --no-transformers --plain-attention ;;
    readme_long_prompts) run 250 python3 benchmarks/rollout.py --prompts 4 --prompt-len 2048 --output-len 1024 --max-num-seqs 32 --no-transformers
                         run 250 python3 benchmarks/rollout.py --prompts 4 --prompt-len 2048 --output-len 1024 --max-num-seqs 32 --no-transformers --plain-attention ;;
    readme_fidelity) run 400 python3 benchmarks/fidelity.py --embed-std 0.09 ;;
    readme_longtail) run 560 python3 benchmarks/longtail_rollout.py --shape qwen3-1.7b --budget-calls 0 ;;
    readme_compiled) run 560 python3 benchmarks/compiled_baseline.py --models qwen3-1.7b --batches 1
                     run 560 python3 benchmarks/compiled_baseline.py --models qwen3-1.7b --batches 64 ;;
    # two GPUs (nvidia-h200-x2): tensor parallelism and the Ray pool
    tp) run 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tensor_parallel.py tests/test_tensor_parallel_spmd.py
        run 400 python3 benchmarks/decode_roofline.py --models llama-3.1-8b --batches 1 64 256 --tensor-parallel 2 ;;
    pool) run 400 python3 benchmarks/pool_rollout.py ;;
  esac
done
