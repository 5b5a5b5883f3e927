#!/usr/bin/env bash
# folded_rows_matmul.py on a GPU, one command each (each under 600 s; run from the repository root, logs to $OUT):
#   bash kernels_lab/folded_rows_checks.sh verify    # the k = 4 verify graphs with their 1 + 4 BF16 rows through the
#       folded kernel (verify_step.py), launched as a dependent that lets the next kernel launch once its weights are
#       read (LAB_FOLDED_PDL=late), in one tile for every matrix, each of `tiles` below in turn, against the export and
#       the decode step; then the first of them launched plainly (the tiles that win a matrix alone do not win in the
#       step: folded_rows_matmul.py's sweep, `sweep` below); then plain decode steps of 2, 4, 8 and 16 sequences through
#       it against the export (LAB_DECODE_ROWS), which a package that routes 2-16 BF16 rows through it would change
#   bash kernels_lab/folded_rows_checks.sh sweep     # each Qwen3-4B matrix at 1 + 4 BF16 rows through the folded
#       kernel in a sweep of tiles against cuBLAS with the small steps around it and the one-row GEMV (the best to
#       $OUT/folded.json)
#   bash kernels_lab/folded_rows_checks.sh sixteen   # 16 rows on Q8_0 planes (16 sequences of a GGUF file): the sweep
#       against chapter 10g's split-K with its sums and small steps, and the one-row int8 group GEMV (and the kernel
#       with x quantized to int8 and int8 products, as llama.cpp multiplies Q8_0: on an H100 2-2.5x slower); then the
#       16-sequence step with its rows through it, the norms handed off (sixteen_seqs_step.py's `folded`), against the
#       export, launched plainly and as a dependent that lets the next kernel launch once its weights are read
#       (LAB_FOLDED_PDL=late)
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
case "${1:-}" in
  verify)
    tiles="32,128,2,3;32,128,1,3;32,128,4,3;32,128,2,4;16,128,2,3;64,128,2,3"
    LAB_GEMV_ROWS=1 LAB_STEPS_ONLY=1 LAB_FOLDED_PDL=late LAB_FOLDED="$tiles" timeout 300 \
      python3 kernels_lab/verify_step.py bf16 > "$out/verify_late.log" 2>&1
    grep -E "decode graph|1 \+ 4" "$out/verify_late.log"
    LAB_GEMV_ROWS=1 LAB_STEPS_ONLY=1 LAB_FOLDED_PDL=0 LAB_FOLDED="${tiles%%;*}" timeout 120 \
      python3 kernels_lab/verify_step.py bf16 > "$out/verify_plain.log" 2>&1
    echo "LAB_FOLDED_PDL=0"; grep -E "1 \+ 4 rows through" "$out/verify_plain.log"
    LAB_GEMV_ROWS=1 LAB_STEPS_ONLY=1 LAB_FOLDED_PDL=late LAB_FOLDED="${tiles%%;*}" LAB_DECODE_ROWS=2,4,8,16 timeout 200 \
      python3 kernels_lab/verify_step.py bf16 > "$out/decode_rows.log" 2>&1
    grep -E "sequences" "$out/decode_rows.log" ;;
  sweep)
    LAB_BEST_OUT="$out/folded.json" timeout 300 python3 kernels_lab/folded_rows_matmul.py 5 bf16 \
      > "$out/folded.log" 2>&1
    tail -6 "$out/folded.log" ;;
  sixteen)
    timeout 330 python3 kernels_lab/folded_rows_matmul.py 16 q8_0 > "$out/folded_sixteen.log" 2>&1
    tail -6 "$out/folded_sixteen.log"
    for mode in 0 late; do
      LAB_FOLDED_PDL=$mode timeout 150 python3 kernels_lab/sixteen_seqs_step.py export,folded \
        > "$out/sixteen_folded_$mode.log" 2>&1
      echo "LAB_FOLDED_PDL=$mode"; grep "^\[" "$out/sixteen_folded_$mode.log"
    done ;;
  *)
    echo "usage: $0 verify|sweep|sixteen" >&2
    exit 2 ;;
esac
