#!/usr/bin/env bash
# The verify step's matmuls on a GPU, in one command (under 600 s; run from the repository root, logs to $OUT):
#   OUT=DIR bash kernels_lab/verify_matmul_checks.sh
# 1. the verify graphs of 1 + 0..4 rows against a decode step as exported (verify_step.py bf16, BF16 rows through
#    chapter 09's rows_matmul up to 5 rows), then with rows_matmul in other tiles (LAB_ROWS_TILES) and at other
#    programs an SM (LAB_PROGRAMS), each in the same process; 2. each Qwen3-4B matrix alone at 5 rows of BF16 weights
#    in those tiles against the one-row GEMV of a decode step on the same weights (rows_matmul_shapes.py, LAB_KINDS=bf16
#    LAB_ROWS=5): which matrices hold the verify step's excess, and at what share of the card's bandwidth each reads.
# Why: on an H100 the verify step of 1 + 4 rows costs 1.132x a decode step; where its tiles gain less than the GEMV
# from an H200's bandwidth, their excess is a larger share of that card's shorter decode step (the target: 1.15x on
# an H200). TILES and PROGRAMS in the environment replace the sweep's. Part 2 on one H100 (rows_matmul_shapes.py's
# docstring): a layer's four matmuls 88.2 µs at 5 rows against 70.8 through the one-row GEMV, 14.7 µs of the excess in
# qkv, o and down, whose best tiles read 1.6-2.2 TB/s against the GEMV's 2.65-2.74. Part 1 not yet run.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD:$PWD/kernels_lab${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
tiles=${TILES:-"32,128,4,3;16,128,2,3;64,128,2,3;32,64,2,4"}
nvidia-smi --query-gpu=name --format=csv,noheader
LAB_GEMV_ROWS=5 LAB_STEPS_ONLY=1 LAB_ROWS_TILES="$tiles" LAB_PROGRAMS=${PROGRAMS:-"6,8"} timeout 330 \
  python3 kernels_lab/verify_step.py bf16 > "$out/verify_matmul_steps.log" 2>&1
grep "graph" "$out/verify_matmul_steps.log"
slashed=${tiles//,//}  # rows_matmul_shapes.py's spelling: BN/BK/W/ST,...
LAB_KINDS=bf16 LAB_ROWS=5 LAB_TILES="32/128/2/3,${slashed//;/,}" LAB_PER_SM=4,8 timeout 200 \
  python3 kernels_lab/rows_matmul_shapes.py time > "$out/verify_matmul_shapes.log" 2>&1
grep -v Warn "$out/verify_matmul_shapes.log"
