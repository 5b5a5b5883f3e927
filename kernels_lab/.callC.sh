export PYTHONPATH=$PWD:$PWD/kernels_lab:$PWD/.whl FORGE_HOME=$PWD/.gpucache PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo $gpu
case "$gpu" in *H200*) LAB_GEMV_ROWS=5 LAB_STEPS_ONLY=1 timeout 140 python3 kernels_lab/verify_step.py bf16 > $OUT/verify.log 2>&1; tail -8 $OUT/verify.log;; esac
timeout 130 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_quant_gpu.py -p no:cacheprovider -k "norms_folded or decode_rows or (rows_matmul and 2560 and 16) or gguf_file_repacked" > $OUT/gputests.log 2>&1; tail -4 $OUT/gputests.log
case "$gpu" in *H200*) ;; *) timeout 60 python3 kernels_lab/sixteen_seqs_step.py export > $OUT/sixteen.log 2>&1; grep -A3 "\]" $OUT/sixteen.log | grep -v Warn;; esac
