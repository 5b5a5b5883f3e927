#!/usr/bin/env bash
# The batch-1 checks on a GPU, one command each (each under 600 s; run from the repository root,
# FORGE_HOME holding the Qwen3 tokenizer, logs and JSON to $OUT):
#   bash kernels_lab/w1_checks.sh tests        # the GPU suite (~370 s on an H200)
#   bash kernels_lab/w1_checks.sh perf         # the bench's W1 for BF16 / int8 / int4, two rounds interleaved
#   bash kernels_lab/w1_checks.sh int4-tiles   # int4's qkv / o / down tiles and every shape's register caps in the
#                                              # decode step (the gate-up's best tile is found there, not in
#                                              # a chain of plain GEMVs)
#   bash kernels_lab/w1_checks.sh ab DIR [V]   # this tree's int4 step against the package in DIR (and variants V),
#                                              # then W1 (int4, BF16, int8, int4) and the int4 GPU tests on the faster
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
case "${1:-}" in
  tests)
    timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
      tests/test_quant_gpu.py 2>&1 | tail -30 > "$out/gpu_tests.txt"
    tail -3 "$out/gpu_tests.txt" ;;
  perf)
    for round in 1 2; do
      for q in none int8 int4; do
        FORGE_COMMIT=${FORGE_COMMIT:-checks} timeout 200 python3 -m forge_engine bench w1 --model random:qwen3-4b \
          --quantization "$q" --json "$out/w1_${q}_$round.json" > "$out/w1_${q}_$round.log" 2>&1
        python3 -c "import json, sys; print(sys.argv[1], json.load(open(sys.argv[2]))['decode_tok_s'])" "$q" \
          "$out/w1_${q}_$round.json" 2>/dev/null || tail -3 "$out/w1_${q}_$round.log"
      done
    done ;;
  int4-tiles)
    variants=$(cd kernels_lab && python3 -c "from decode_overlap import INT4_CAPS as caps, INT4_TILES as t
print(','.join([f'int4 {n} ' + 'x'.join(map(str, c)) for n in t for c in t[n]]
               + [f'int4 {n} maxnreg {c}' for n in caps for c in caps[n]]))")
    (cd kernels_lab && LAB_NO_CHAIN=1 LAB_VARIANTS="defaults,$variants,defaults again" \
      timeout 540 python3 decode_overlap.py int4 > "$out/int4_tiles.txt" 2>&1); grep "step graph\|VALID" "$out/int4_tiles.txt" ;;
  ab)  # this tree's int4 step against the package in $2 (e.g. `git archive C forge_engine | tar -x -C .device_old`),
       # old / new / old; then the bench's W1 (int4, BF16, int8, int4) and the int4 GPU tests on the faster one
    old=$(cd "$2" && pwd); new=$PWD
    for tree in old new old; do
      dir=$([ $tree = old ] && echo "$old" || echo "$new")
      (cd kernels_lab && PYTHONPATH=$dir LAB_NO_CHAIN=1 LAB_VARIANTS="defaults${3:+,$3}" timeout 120 \
        python3 decode_overlap.py int4 >> "$out/ab_$tree.txt" 2>&1)
    done
    grep -H "step graph\|Error" "$out"/ab_*.txt
    best=$(python3 -c "import re, sys, statistics as st
ms = {t: st.median(map(float, re.findall(r'defaults\s*: step graph ([0-9.]+)', open(f'$out/ab_{t}.txt').read())))
      for t in ('old', 'new')}
print(min(ms, key=ms.get))")
    dir=$([ $best = old ] && echo "$old" || echo "$new"); echo "faster: $best ($dir)"
    # (run from $dir: `python3 -m` puts the working directory before PYTHONPATH, so run from elsewhere it would
    # measure the repository's package both times)
    for q in int4 none int8 int4; do
      (cd "$dir" && PYTHONPATH=$dir FORGE_COMMIT=$best timeout 200 python3 -m forge_engine bench w1 \
        --model random:qwen3-4b --quantization $q --json "$out/w1_$q.json" > "$out/w1_$q.log" 2>&1)
      python3 -c "import json, sys; print(sys.argv[1], json.load(open(sys.argv[2]))['decode_tok_s'])" $q \
        "$out/w1_$q.json" 2>/dev/null || tail -3 "$out/w1_$q.log"
    done
    (cd "$dir" && PYTHONPATH=$dir timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
      "$new/tests/test_quant_gpu.py" 2>&1 | tail -2) ;;
  *) echo "usage: bash kernels_lab/w1_checks.sh tests|perf|int4-tiles|ab OLD_PACKAGE_DIR [VARIANTS]" >&2; exit 2 ;;
esac
