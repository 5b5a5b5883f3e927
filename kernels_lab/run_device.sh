#!/usr/bin/env bash
# Everything the lab measures on a GPU in one go: the GPU tests, then each lab
# file. Run from the repository root; logs go to $OUT (or /tmp), results also as JSON lines.
# LAB_VARIANTS=v0,v3 keeps only variants with those prefixes; LAB_TIMEOUT bounds each lab file.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=. PYTHONUNBUFFERED=1 LAB_RESULTS=$out/lab_results.jsonl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py 2>&1 | tee "$out/pytest_gpu.log"
for lab in ${LABS:-decode_attention prefill_attention rmsnorm}; do
  timeout "${LAB_TIMEOUT:-100}" python3 "kernels_lab/$lab.py" 2>&1 | tee "$out/lab_$lab.log"
done
