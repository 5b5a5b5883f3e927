#!/usr/bin/env bash
# Chapter 09's rows GEMV at several rows of x on a GPU, in one command (under 600 s; run from the repository root,
# logs to $OUT; the tests need the Qwen3 tokenizer in $FORGE_HOME: `forge-engine models pull qwen3-tokenizer`):
#   bash kernels_lab/verify_rows_checks.sh
# 1. the GPU tests of the rows GEMV (Qwen3-4B's shapes at 1, 5 and 8 rows; a BF16 step of 3 and 8 sequences against
#    cuBLAS) and of the one-row folds; 2. the rows layout swept per matrix at 5 rows (1 + k) with the norms handed
#    off (few_rows_matmul.py, its winners to $OUT/rows.json); 3. the k = 4 verify graphs with BF16 rows through it in
#    those tiles, against the export (verify_step.py). Whether chapter 09a's GEMV_ROWS_BF16 rises past 1 is 3's call.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
  -k "rows_gemv or gemv_layouts or folded" 2>&1 | tail -30 > "$out/rows_tests.txt"
tail -3 "$out/rows_tests.txt"
LAB_FOLD=handoff LAB_BEST_OUT="$out/rows.json" timeout 280 python3 kernels_lab/few_rows_matmul.py 5 \
  > "$out/few_rows.log" 2>&1
grep -v "^  " "$out/few_rows.log"
LAB_STEPS_ONLY=1 LAB_ROWS_CONFIGS="$out/rows.json" timeout 200 python3 kernels_lab/verify_step.py bf16 \
  > "$out/verify_step.log" 2>&1
tail -7 "$out/verify_step.log"
