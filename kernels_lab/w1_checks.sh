#!/usr/bin/env bash
# What a GPU session of issue 6 starts with, in two device calls of under 600 s each (run from the repository root,
# FORGE_HOME holding the Qwen3 tokenizer, logs and JSON to $OUT):
#   bash kernels_lab/w1_checks.sh tests   # the GPU suite (~250 s on an H200)
#   bash kernels_lab/w1_checks.sh perf    # the unmeasured switches A/B in the decode step, the argmax lab, W1 x3
# Written in session 21, when three changes had not run on a GPU: the argmax in the decode graph (chapter 09b's
# GREEDY_IN_GRAPH), greedy steps' sampling tensors kept on the host (chapter 06) and RoPE from positions in the
# decode kernel (chapter 09's DECODE_ROPE_FROM_POSITIONS).
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
case "${1:-}" in
  tests)
    timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
      tests/test_quant_gpu.py 2>&1 | tail -30 > "$out/gpu_tests.txt"
    tail -3 "$out/gpu_tests.txt" ;;
  perf)
    (cd kernels_lab && LAB_NO_CHAIN=1 LAB_VARIANTS="defaults,RoPE tables,merge split by split,defaults again" \
      timeout 150 python3 decode_overlap.py int8,bf16 > "$out/switches.txt" 2>&1); grep "step graph\|VALID" "$out/switches.txt"
    timeout 120 python3 kernels_lab/greedy_in_graph.py bf16,int8 > "$out/greedy.txt" 2>&1; grep "tok/s\|VALID\|FAIL" "$out/greedy.txt"
    for q in none int8 int4; do
      FORGE_COMMIT=${FORGE_COMMIT:-checks} timeout 80 python3 -m forge_engine bench w1 --model random:qwen3-4b \
        --quantization "$q" --json "$out/w1_$q.json" > "$out/w1_$q.log" 2>&1
      python3 -c "import json, sys; print(sys.argv[1], json.load(open(sys.argv[2]))['decode_tok_s'])" "$q" "$out/w1_$q.json" \
        2>/dev/null || tail -3 "$out/w1_$q.log"
    done ;;
  *) echo "usage: bash kernels_lab/w1_checks.sh tests|perf" >&2; exit 2 ;;
esac
