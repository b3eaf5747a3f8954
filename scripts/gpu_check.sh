#!/usr/bin/env bash
# What only a GPU can check, in one pass of 9 minutes on one H100: the headline (GPT-2 124M with
# every GPU speedup on), what each speedup buys, time to a target loss, decoding, memory, the
# CUDA tests. The plan, its budget and every part: scripts/gpu_check.py.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine
#   bash scripts/gpu_check.sh --plan          # what would run, each part's limit; runs nothing
#   bash scripts/gpu_check.sh --cpu           # the same plan at tiny sizes on the CPU
#   bash scripts/gpu_check.sh --results DIR   # write somewhere else than bench_results/
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET, GPU_CHECK_PARTS, GPU_CHECK_WHEELS,
# GPU_CHECK_DATASET, GPU_CHECK_CACHE (python3 scripts/gpu_check.py --help says what each does).
PYTHON=${PYTHON:-python3}
export PYTHON
exec "$PYTHON" "$(dirname "$0")/gpu_check.py" "$@"
