#!/usr/bin/env bash
# The quantized tiles of chapter 09's rows_matmul on a GPU, one command each (each under 600 s; run from the
# repository root, logs to $OUT; a GGUF run needs the `gguf` package on PYTHONPATH):
#   bash kernels_lab/quant_rows_checks.sh tests   # the GPU tests of rows_matmul (BF16, int8 groups, int4 pairs in
#       int4's own tile) and of decode steps of 2-16 sequences through it (BF16, int8 groups, int4, a Q4_K_M mix)
#   bash kernels_lab/quant_rows_checks.sh steps   # the 16-sequence decode step as exported against split-K and the
#       separate small kernels on Q4_K_M-mixed planes and on --quantization int4 (sixteen_seqs_step.py export,split)
#   bash kernels_lab/quant_rows_checks.sh programs  # the programs an SM of the int8 and int4 launches on another
#       GPU: the export (int8 at 8, int4 at 4) against int8 at 4 and 12 on Q8_0 planes and int4 at 6 and 8 on Q4_K planes
#   bash kernels_lab/quant_rows_checks.sh imma    # rows_matmul_imma.py: x quantized to int8, int8 tensor-core
#       products, per Qwen3-4B matrix at 16 rows against the export
#   bash kernels_lab/quant_rows_checks.sh tiles   # int4's tile on another GPU: the export's (64/128/4/3) against its
#       neighbours on Q4_K planes (sixteen_seqs_step.py tile4=...)
#   bash kernels_lab/quant_rows_checks.sh shapes8|shapes4  # rows_matmul_shapes.py: each Qwen3-4B matrix at 16 rows in
#       a grid of tiles and programs an SM, int8 (Q8_0) or int4 (Q4_K) planes, each matrix's best against the export
#   bash kernels_lab/quant_rows_checks.sh tiles8  # the int8 tile through bf16's bits at eight programs an SM: the
#       export's (32/128/2/3) against wider ones on Q8_0 planes (every program reads its x columns again: a tile of 32
#       rows reads as many bytes of x from L2 as of int8 weights)
#   bash kernels_lab/quant_rows_checks.sh diff NAME.diff  # a copy of this package with a diff from kernels_lab applied
#       (`patch -p1`; made with `git diff -- forge_engine/kernels/rows_matmul.py`): its GPU tests of rows_matmul and of
#       2-16-sequence steps, then the 16-sequence step on Q8_0 and Q4_K planes as exported, this package's and the
#       copy's in turn (sixteen_seqs_step.py export). Measured so on an H100: the scales (and int4's minimums) loaded a
#       step ahead (as compiled, each step loads them outside Triton's pipeline, LDG.E.U16 before its HMMAs): Q8_0
#       2.854 ms a 16-row step against 2.868, Q4_K 3.202 against 3.202; other warps hide that wait (not kept)
#       The int8 SwiGLU launch (gate-up) at 6 programs an SM rather than 8, so that its 912 programs fit one wave (now
#       the package): Q8_0 2.802-2.803 ms against 2.862 (two calls), at 4 an SM 2.989; Q4_K unchanged (3.191 against
#       3.194: int4 keeps its own programs)
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD:$PWD/kernels_lab${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step() {  # LAB_PLANES, variants, log name: the lines that name a variant and the graph's largest kernels
  LAB_PLANES=$1 timeout 170 python3 kernels_lab/sixteen_seqs_step.py "$2" > "$out/$3.log" 2>&1
  grep -A3 "^\[" "$out/$3.log" | sed "s/^/$3 /"
}
case "${1:-}" in
  tests)
    timeout 400 python3 -m pytest -m gpu tests/test_gpu.py -q -k "rows_matmul_on or decode_rows" \
      > "$out/rows_tests.log" 2>&1
    tail -3 "$out/rows_tests.log" ;;
  steps)
    step q4_k_m export,split q4_k_m
    step int4 export,split int4 ;;
  programs)
    step q8_0 export,programs=4,programs=12 q8_0_programs
    step q4_k export,programs=6,programs=8 q4_k_programs ;;
  tiles8)
    step q8_0 export,tile=64/128/2/3,tile=64/128/4/3 q8_0_tiles
    step q8_0 tile=32/256/2/3,tile=128/128/4/3 q8_0_tiles_wide ;;
  shapes8|shapes4)
    kind=int${1#shapes}
    LAB_KINDS=$kind timeout 560 python3 kernels_lab/rows_matmul_shapes.py time > "$out/shapes_$kind.log" 2>&1
    grep -v Warn "$out/shapes_$kind.log" ;;
  imma)
    timeout 200 python3 kernels_lab/rows_matmul_imma.py time > "$out/imma.log" 2>&1
    grep -v Warn "$out/imma.log" ;;
  tiles)
    step q4_k export,tile4=32/128/2/3,tile4=64/256/4/3,tile4=128/128/8/3,tile4=64/128/4/4 q4_k_tiles ;;
  diff)
    copy=$(mktemp -d)
    cp -r forge_engine "$copy/"
    patch -s -p1 -d "$copy" < "kernels_lab/${2:?usage: quant_rows_checks.sh diff NAME.diff}" || exit 1
    (cd "$copy" && PYTHONPATH=$copy:$PYTHONPATH timeout 300 python3 -m pytest -m gpu "$OLDPWD/tests/test_gpu.py" -q \
      -p no:cacheprovider -k "rows_matmul_on or decode_rows" > "$out/rows_tests_diff.log" 2>&1)
    tail -1 "$out/rows_tests_diff.log"
    for planes in q8_0 q4_k; do
      step $planes export "${planes}_now"
      PYTHONPATH=$copy:$PYTHONPATH step $planes export "${planes}_diff"
    done ;;
  *)
    echo "usage: bash kernels_lab/quant_rows_checks.sh tests|steps|programs|shapes8|shapes4|imma|tiles|tiles8|diff NAME.diff" >&2
    exit 2 ;;
esac
