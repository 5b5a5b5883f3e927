#!/usr/bin/env bash
# folded_rows_matmul.py on a GPU, in one command (under 600 s; run from the repository root, logs to $OUT):
#   bash kernels_lab/folded_rows_checks.sh
# 1. each BF16 matrix of Qwen3-4B at 1 + 4 rows through the folded kernel in a sweep of tiles, against cuBLAS with the
#    small steps around it and the one-row GEMV (the best tiles to $OUT/folded.json); 2. the k = 4 verify graphs with
#    their rows through it in those tiles, against the export and the decode step (verify_step.py), then the same with
#    the step's small kernels launched as dependents too (LAB_DEPENDENT_ROWS=5), as a one-row step launches them.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LAB_BEST_OUT="$out/folded.json" timeout 300 python3 kernels_lab/folded_rows_matmul.py 5 > "$out/folded.log" 2>&1
tail -6 "$out/folded.log"
for dependent in "" 5; do
  LAB_GEMV_ROWS=1 LAB_STEPS_ONLY=1 LAB_FOLDED_TILES="$out/folded.json" LAB_FOLDED="64,128,4,3" \
    LAB_DEPENDENT_ROWS=$dependent timeout 130 python3 kernels_lab/verify_step.py bf16 \
    > "$out/verify_folded${dependent}.log" 2>&1
  tail -3 "$out/verify_folded${dependent}.log"
done
