#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine in one command (7 min 50 s at most: the steps' limits add up to 470 s):
# the all-reduce lab (kernels_lab/tp_allreduce.py: symmetric memory against NCCL, validated and timed), the GPU tests
# (tests/test_tp_gpu.py), then W1 and W2 on $MODEL (default random:qwen3-4b; random:qwen3-14b for the larger
# shape) at --tensor-parallel-size 2 (the default symmetric-memory all-reduces; FORGE_TP_ALL_REDUCE=nccl in the
# environment for NCCL) and at 1, and rank 0's GPU time in a 256-sequence decode step at TP=2
# (kernels_lab/tp_step_profile.py); steps overlap by default. FORGE_HOME must hold the models' tokenizer (qwen3-tokenizer: `forge-engine models pull qwen3-tokenizer`).
# (kernels_lab/tp_step_message.py needs no GPU: run it anywhere.)
# Run from the repository root: OUT=/some/dir [MODEL=random:qwen3-14b] bash kernels_lab/tp_gpu_check.sh
# Logs under $OUT: one per step, summary.txt (exit code and seconds of each), tp_allreduce.json,
# bench_*/<hardware>/*.json (their "tensor_parallel" part: which all-reduce path ran, its time per step and share).
# Every step runs under `timeout` in its own process group: at its limit every process of it, the
# tensor-parallel workers too, gets SIGUSR1 and dumps its Python stacks (FORGE_TP_STACKS registers the
# handler; a worker also dumps by itself when one message takes over FORGE_TP_STACKS seconds), then
# SIGKILL 5 s later, and the next step starts on free GPUs (whatever a step started in a process session of its own,
# as the killed-worker test does, is killed too: a leftover process spinning on a GPU slows every later step).
# NVLink multicast stays off (nothing here uses it).
set -uo pipefail
out=${OUT:-/tmp/tp_gpu_check}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 FORGE_TP_STACKS=40 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout -s USR1 -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s$([ $rc = 124 ] || [ $rc = 137 ] && echo ' (TIMED OUT: stacks in the log)')" \
    | tee -a "$out/summary.txt"
  tail -n 4 "$out/$name.log"
  pkill -9 -f "forge_engine|multiprocessing.spawn" 2>/dev/null; sleep 1
}

# the benches and the killed-worker test need the tokenizer where FORGE_HOME points (no model hub on the GPU machine)
python3 -m forge_engine models verify qwen3-tokenizer | tee "$out/summary.txt" \
  || { echo "FORGE_HOME (${FORGE_HOME:-unset}) has no verified qwen3-tokenizer: pull it there first" | tee -a "$out/summary.txt"; exit 2; }
nvidia-smi --query-gpu=index,name,memory.used --format=csv > "$out/gpu.txt" 2>&1
nvidia-smi topo -m >> "$out/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
step tp_allreduce 50 python3 kernels_lab/tp_allreduce.py --out "$out"
step pytest_tp_gpu 130 python3 -m pytest -v -s -p no:cacheprovider -m gpu -o faulthandler_timeout=110 tests/test_tp_gpu.py
bench=(python3 -m forge_engine bench all --model "${MODEL:-random:qwen3-4b}" --workloads w1,w2)
step bench_tp2 100 "${bench[@]}" --tensor-parallel-size 2 --out "$out/bench_tp2"
step tp_profile 100 python3 kernels_lab/tp_step_profile.py --tp=2 --model="${MODEL:-random:qwen3-4b}"
step bench_tp1 90 "${bench[@]}" --out "$out/bench_tp1"
grep -h "W1 \|W2 " "$out"/bench_tp*.log | tee -a "$out/summary.txt"
grep -h "decode step:" "$out/tp_allreduce.log" | tee -a "$out/summary.txt"
grep -h -A6 "seqs=" "$out/tp_profile.log" | tee -a "$out/summary.txt"
