export PYTHONPATH=$PWD:$PWD/kernels_lab:$PWD/.whl FORGE_HOME=$PWD/.gpucache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 kernels_lab/sixteen_seqs_step.py export,tile=32/256/2/3,tile=32/128/4/3,tile=64/128/4/3,tile=32/256/4/3,tile=64/256/4/3,tile=16/256/2/3,tile=32/128/2/4,tile=32/128/1/3 > $OUT/sixteen.log 2>&1; grep "\]" $OUT/sixteen.log; grep -B2 -A3 Error $OUT/sixteen.log | tail
