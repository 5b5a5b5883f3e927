#!/usr/bin/env bash
# Chapter 09's verify kernel (`_verify_kernel`) on a GPU, in one command (under 600 s; run from the repository root,
# logs to $OUT; the tests need the Qwen3 tokenizer in $FORGE_HOME: `forge-engine models pull qwen3-tokenizer`):
#   OUT=DIR [BEFORE=DIR] bash kernels_lab/verify_attention_checks.sh
# 1. its GPU tests (verify rows against storing every row first, verify graphs that keep the greedy tokens, decode
#    rows of 2-16 sequences); 2. the verify graphs of 1 + 0..4 rows against a decode step (verify_step.py, BF16 rows
#    through rows_matmul up to 5 rows); 3. with BEFORE, a folder holding another forge_engine (`git archive COMMIT
#    forge_engine | tar -x -C DIR`, carried to the GPU machine), the same graphs from that package, in the same call;
#    4. the attention alone (verify_attention_rows.py): a program per row against the package's verify call.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
lab=$PWD/kernels_lab
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -k "verify or decode_rows" > "$out/verify_tests.log" 2>&1
tail -3 "$out/verify_tests.log"
steps() {  # PYTHONPATH's package, label
  PYTHONPATH=$1:$lab LAB_GEMV_ROWS=5 LAB_STEPS_ONLY=1 timeout 130 python3 kernels_lab/verify_step.py bf16 \
    > "$out/verify_step_$2.log" 2>&1
  grep "graph" "$out/verify_step_$2.log" | sed "s/^/$2 /"
}
steps "$PWD" now
if [ -n "${BEFORE:-}" ]; then steps "$BEFORE" before; fi
PYTHONPATH=$PWD:$lab timeout 150 python3 kernels_lab/verify_attention_rows.py time > "$out/verify_rows.log" 2>&1
grep -v Warn "$out/verify_rows.log"
