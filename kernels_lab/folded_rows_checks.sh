#!/usr/bin/env bash
# folded_rows_matmul.py on a GPU, one command each (each under 600 s; run from the repository root, logs to $OUT):
#   bash kernels_lab/folded_rows_checks.sh verify    # 1 + 4 BF16 rows: each Qwen3-4B matrix through the folded kernel
#       in a sweep of tiles against cuBLAS with the small steps around it and the one-row GEMV (the best tiles to
#       $OUT/folded.json), then the k = 4 verify graphs with their rows through it in those tiles against the export
#       and the decode step (verify_step.py), the kernel launched plainly and as a dependent (LAB_FOLDED_PDL late, wait),
#       also with the small kernels around it launched as dependents (LAB_DEPENDENT_ROWS=5)
#   bash kernels_lab/folded_rows_checks.sh sixteen   # 16 rows on Q8_0 planes (16 sequences of a GGUF file): the sweep
#       against chapter 10g's split-K with its sums and small steps, and the one-row int8 group GEMV (and the kernel with x
#       quantized to int8 and int8 products, as llama.cpp multiplies Q8_0); then the 16-sequence
#       step with its rows through it, the norms handed off (sixteen_seqs_step.py's `folded`), against the export,
#       launched plainly and as a dependent that lets the next kernel launch once its weights are read (LAB_FOLDED_PDL=late)
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
case "${1:-}" in
  verify)
    LAB_BEST_OUT="$out/folded.json" timeout 300 python3 kernels_lab/folded_rows_matmul.py 5 bf16 \
      > "$out/folded.log" 2>&1
    tail -6 "$out/folded.log"
    for run in 0: late: wait: 0:5 late:5; do  # LAB_FOLDED_PDL:LAB_DEPENDENT_ROWS
      mode=${run%:*} dependent=${run#*:}
      LAB_GEMV_ROWS=1 LAB_STEPS_ONLY=1 LAB_FOLDED_TILES="$out/folded.json" LAB_FOLDED="64,64,4,3" \
        LAB_FOLDED_PDL=$mode LAB_DEPENDENT_ROWS=$dependent timeout 80 python3 kernels_lab/verify_step.py bf16 \
        > "$out/verify_folded_$mode$dependent.log" 2>&1
      echo "LAB_FOLDED_PDL=$mode LAB_DEPENDENT_ROWS=$dependent"; tail -2 "$out/verify_folded_$mode$dependent.log"
    done ;;
  sixteen)
    timeout 330 python3 kernels_lab/folded_rows_matmul.py 16 q8_0 > "$out/folded_sixteen.log" 2>&1
    tail -6 "$out/folded_sixteen.log"
    for mode in 0 late; do
      LAB_FOLDED_PDL=$mode timeout 150 python3 kernels_lab/sixteen_seqs_step.py export,folded,folded_int8 \
        > "$out/sixteen_folded_$mode.log" 2>&1
      echo "LAB_FOLDED_PDL=$mode"; grep "^\[" "$out/sixteen_folded_$mode.log"
    done ;;
  *)
    echo "usage: $0 verify|sixteen" >&2
    exit 2 ;;
esac
