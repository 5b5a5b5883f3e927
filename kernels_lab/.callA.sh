export PYTHONPATH=$PWD:$PWD/kernels_lab:$PWD/.whl FORGE_HOME=$PWD/.gpucache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -x > $OUT/gputests.log 2>&1; tail -25 $OUT/gputests.log
LAB_GEMV_ROWS=5 LAB_STEPS_ONLY=1 LAB_FOLDED="32,128,2,3" LAB_FOLDED_PDL=late timeout 220 python3 kernels_lab/verify_step.py bf16 > $OUT/verify.log 2>&1; tail -30 $OUT/verify.log
