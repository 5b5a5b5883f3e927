#!/usr/bin/env bash
# Chapter 10h's offload modes on a GPU, one command each (each under 600 s; run from the repository root, logs to
# $OUT; the tests need the Qwen3 tokenizer in $FORGE_HOME: `forge-engine models pull qwen3-tokenizer`):
#   bash kernels_lab/offload_rows_checks.sh tests     # the GPU tests of the split, streamed and auto modes
#   bash kernels_lab/offload_rows_checks.sh offload   # Qwen3-14B int4 under 8 GiB: auto's choice, streaming's W1,
#                                                     # the CPU mode's W1 and a 512-token prompt's first token
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
case "${1:-}" in
  tests)
    timeout 550 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
      -k "streamed or split_with_the_cpu or offload_auto" 2>&1 | tail -30 > "$out/offload_tests.txt"
    tail -3 "$out/offload_tests.txt" ;;
  offload)
    timeout 280 python3 kernels_lab/offload_streaming.py > "$out/offload_streaming.log" 2>&1
    tail -4 "$out/offload_streaming.log"
    timeout 300 python3 kernels_lab/offload_bandwidth.py > "$out/offload_bandwidth.log" 2>&1
    tail -12 "$out/offload_bandwidth.log" ;;
  *)
    echo "usage: $0 tests|offload" >&2
    exit 2 ;;
esac
