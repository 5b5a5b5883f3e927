#!/usr/bin/env bash
# Chapter 09's verify kernel (`_verify_kernel`) on a GPU, in one command (under 600 s; run from the repository root,
# logs to $OUT; the tests need the Qwen3 tokenizer in $FORGE_HOME: `forge-engine models pull qwen3-tokenizer`):
#   OUT=DIR [BEFORE=DIR] [VARIANTS="NAME=A.diff[+B.diff] ..."] bash kernels_lab/verify_attention_checks.sh
# 1. its GPU tests (verify rows against storing every row first, verify graphs that keep the greedy tokens, decode
#    rows of 2-16 sequences); 2. the verify graphs of 1 + 0..4 rows against a decode step (verify_step.py, BF16 rows
#    through rows_matmul up to 5 rows); 3. with BEFORE, a folder holding another forge_engine (`git archive COMMIT
#    forge_engine | tar -x -C DIR`, carried to the GPU machine), the same graphs from that package, in the same call;
#    4. the attention alone (verify_attention_rows.py): a program per row against the package's verify call.
# VARIANTS: for each, a copy of this forge_engine with kernels_lab's diffs applied in turn (`patch -p1`), then its
# verify tests and its verify graphs, in the same call (about 105 s a variant). The diffs kept here, each checked
# under the interpreter by chapter 09's tests and compiled for sm_90 (`decode_sass.py`'s verify_sass):
#   verify_splits_by_length.diff  each sequence spreads its keys over all the launch's splits (64-key tiles), where
#                                 the splits come from the table's width (a 512-token sequence in a 2K table holds
#                                 keys in 4 of 16 splits as exported)
#   verify_early_exit.diff        programs with no rows (a chunk's later rows) or no keys return at once
#   verify_step_keys_first.diff   only the split that takes the step loads, rotates, stores and attends to the step's
#                                 K/V, before the pool's keys: a 4-row chunk at 4 warps 182 registers at 128-key
#                                 tiles against 244, and an 8-row chunk (a 32-row tile) no longer spills
#   verify_tile_rows.diff         (after verify_step_keys_first.diff) a tile of as many of a sequence's rows as the
#                                 step holds: 1 + 4 rows in one chunk, the keys read once
# e.g. VARIANTS="first=verify_step_keys_first.diff
#   all=verify_splits_by_length.diff+verify_early_exit.diff+verify_step_keys_first.diff
#   tile=verify_splits_by_length.diff+verify_early_exit.diff+verify_step_keys_first.diff+verify_tile_rows.diff"
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
root=$PWD
lab=$root/kernels_lab
verify_tests() {  # package dir, label, -k expression (from the package's folder: its forge_engine comes first)
  (cd "$1" && PYTHONPATH=$1:$lab timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
    "$root/tests/test_gpu.py" -k "$3" > "$out/verify_tests_$2.log" 2>&1)
  tail -1 "$out/verify_tests_$2.log" | sed "s/^/$2 /"
}
steps() {  # package dir, label
  PYTHONPATH=$1:$lab LAB_GEMV_ROWS=5 LAB_STEPS_ONLY=1 timeout 130 python3 kernels_lab/verify_step.py bf16 \
    > "$out/verify_step_$2.log" 2>&1
  grep "graph" "$out/verify_step_$2.log" | sed "s/^/$2 /"
}
rows() {  # package dir, label
  PYTHONPATH=$1:$lab timeout 100 python3 kernels_lab/verify_attention_rows.py time > "$out/verify_rows_$2.log" 2>&1
  grep -v Warn "$out/verify_rows_$2.log" | sed "s/^/$2 /"
}
verify_tests "$root" now "verify or decode_rows"
steps "$root" now
if [ -n "${BEFORE:-}" ]; then steps "$BEFORE" before; fi
rows "$root" now
for variant in ${VARIANTS:-}; do
  name=${variant%%=*}
  dir=$(mktemp -d)
  cp -r "$root/forge_engine" "$dir/"
  for diff in $(echo "${variant#*=}" | tr + ' '); do
    patch -s -p1 -d "$dir" < "$lab/$diff" || { echo "$name: $diff does not apply"; continue 2; }
  done
  verify_tests "$dir" "$name" verify
  steps "$dir" "$name"
done
