#!/usr/bin/env bash
# Chapter 09's verify kernel (`_verify_kernel`) on a GPU, in one command (under 600 s; run from the repository root,
# logs to $OUT; the tests need the Qwen3 tokenizer in $FORGE_HOME: `forge-engine models pull qwen3-tokenizer`):
#   OUT=DIR [BEFORE=DIR] [VARIANTS="NAME=A.diff[+B.diff] ..."] bash kernels_lab/verify_attention_checks.sh
# 1. its GPU tests (verify rows against storing every row first, verify graphs that keep the greedy tokens, decode
#    rows of 2-16 sequences); 2. the verify graphs of 1 + 0..4 rows against a decode step (verify_step.py, BF16 rows
#    through rows_matmul up to 5 rows); 3. with BEFORE, a folder holding another forge_engine (`git archive COMMIT
#    forge_engine | tar -x -C DIR`, carried to the GPU machine), the same graphs from that package, in the same call;
#    4. the attention alone (verify_attention_rows.py): a program per row against the package's verify call.
# VARIANTS: for each, a copy of this forge_engine with diffs from kernels_lab applied in turn (`patch -p1`), then its
# verify tests and its verify graphs, in the same call (about 80 s a variant); a diff is made with `git diff --
# forge_engine/kernels/paged_attention.py` on a change to the exported module, and kept only until it is measured.
# Measured this way on an H100 (1 + 1..3 and 1 + 4 rows, each a decode step's multiple): the step's K/V taken first by
# the split that holds them 1.118-1.132x and 1.169x, with idle programs returning at once as well 1.121-1.128x and
# 1.143x (both now the package), against 1.144-1.146x and 1.190x; on top of that, splits that follow each sequence's
# length 1.129-1.152x and 1.180x, and one 32-row tile for 1 + 4 rows 1.277x (not kept).
# Then rerun (two calls, one H100): 1 + 1..3 rows 1.126-1.133x, 1 + 4 rows 1.144-1.148x. The kernel launched as a
# dependent at every row count and waiting for the projection only after its scans of the step's rows and its early
# return (now the package; another H100, two runs in one call): 1 + 1..3 rows 1.117-1.126x, 1 + 4 rows 1.132-1.133x,
# against 1.127-1.132x and 1.145x; with the step's other small kernels dependents at 5 rows as well
# (LAB_CONSTANTS="DEPENDENT_LAUNCH_MAX_ROWS=5" to verify_step.py): 1.132x, no gain.
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
