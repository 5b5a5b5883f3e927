#!/usr/bin/env bash
# W1 and W2 for the Qwen3-4B shape in BF16 on one GPU, with the transformers peers in the same run:
# JSON results and PNG plots under docs/benchmarks/<gpu>/ (see docs/benchmarks.md).
#   bash docs/benchmarks/run_h200.sh            # from the repository root, on the GPU machine
# Needs torch, triton, transformers, matplotlib; the qwen3 tokenizer in FORGE_HOME (random weights need no download).
# The peers are cut to keep the run short: W1's transformers generate decodes 64 tokens (its decode rate is what
# is compared), and generate_batch runs the first 64 of W2's 256 prompts, forge-engine the same 64 for the ratio.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m forge_engine bench all --model random:qwen3-4b --workloads w1,w2 --peers \
    --peer-output-len 64 --peer-num-prompts 64 --out docs/benchmarks "$@"
