#!/usr/bin/env bash
# The GPU results that docs/benchmarks.md and the README report, for the Qwen3-4B shape on one GPU:
# W1 and W2 in BF16 with the transformers peers in the same run, then W1 with int8 and int4 weights.
# JSON results and PNG plots go under docs/benchmarks/<gpu>/ (file names carry the commit).
#   bash docs/benchmarks/run_h200.sh            # from the repository root, on the GPU machine
# Needs torch, triton, transformers and matplotlib; the qwen3 tokenizer in FORGE_HOME
# (random weights need no download). A tree copied without its git history names its commit in FORGE_COMMIT.
# The peers are cut to keep the run short: W1's transformers generate decodes 64 tokens (its decode rate is what
# is compared), and generate_batch runs the first 64 of W2's 256 prompts, forge-engine the same 64 for the ratio.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m forge_engine bench all --model random:qwen3-4b --workloads w1,w2 --peers \
    --peer-output-len 64 --peer-num-prompts 64 --out docs/benchmarks "$@"
for weights in int8 int4; do
    python3 -m forge_engine bench w1 --model random:qwen3-4b --quantization "$weights" --out docs/benchmarks "$@"
done
