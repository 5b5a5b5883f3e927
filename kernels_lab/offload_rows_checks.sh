#!/usr/bin/env bash
# Chapter 10h's offload modes and chapter 09's GEMV on more rows, on a GPU, one command each (each under 600 s; run
# from the repository root, logs to $OUT):
#   bash kernels_lab/offload_rows_checks.sh tests     # the GPU tests of the split, streamed, auto modes and the GEMVs
#   bash kernels_lab/offload_rows_checks.sh offload   # Qwen3-14B int4 under 8 GiB: auto's choice, streaming's W1,
#                                                     # the CPU mode's W1 and a 512-token prompt's first token
#   bash kernels_lab/offload_rows_checks.sh rows      # gemv's dot tiles swept at 5 and 16 rows; the verify step of
#                                                     # random Qwen3-4B with its rows through the folded GEMVs
#   bash kernels_lab/offload_rows_checks.sh gguf      # a GGUF file's repacked layers at 16 rows: split-K against
#                                                     # gemv's dot with group scales (needs the gguf package)
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
case "${1:-}" in
  tests)
    timeout 550 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
      -k "streamed or split_with_the_cpu or offload_auto or gemv" 2>&1 | tail -30 > "$out/offload_tests.txt"
    tail -3 "$out/offload_tests.txt" ;;
  offload)
    timeout 280 python3 kernels_lab/offload_streaming.py > "$out/offload_streaming.log" 2>&1
    tail -4 "$out/offload_streaming.log"
    timeout 300 python3 kernels_lab/offload_bandwidth.py > "$out/offload_bandwidth.log" 2>&1
    tail -12 "$out/offload_bandwidth.log" ;;
  rows)
    LAB_GEMV_ONLY=1 timeout 300 python3 kernels_lab/few_rows_matmul.py 5,16 > "$out/few_rows.log" 2>&1
    grep -v "^  skip" "$out/few_rows.log" | tail -24
    for gemv_rows in 1 8; do
      LAB_STEPS_ONLY=1 LAB_GEMV_ROWS=$gemv_rows timeout 140 python3 kernels_lab/verify_step.py bf16 \
        > "$out/verify_gemv_rows_$gemv_rows.log" 2>&1
      tail -10 "$out/verify_gemv_rows_$gemv_rows.log"
    done ;;
  gguf)
    (cd kernels_lab && timeout 550 python3 gguf_rows_sweep.py > "$out/gguf_rows.log" 2>&1)
    grep -E "16 rows|GEMV" "$out/gguf_rows.log" | tail -40 ;;
  *)
    echo "usage: $0 tests|offload|rows|gguf" >&2
    exit 2 ;;
esac
