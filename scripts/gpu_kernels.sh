#!/usr/bin/env bash
# The GPU checks of the routing kernels, in one run (about 8 minutes on an H200):
#   1. scripts/device_check.py: every backend on the GPU vs the CPU, MiTA and MoBA on both kernels
#   2. lra-bench attention: full vs MiTA / MoBA on the PyTorch path, then on the Triton kernels
#   3. lra-bench model (the MiTA paper's setup): full vs MiTA on the Triton kernels
#   4. scripts/profile_step.py: where MiTA's step time goes, by operator and kernel (model level at
#      PROFILE_LENGTH x PROFILE_BATCH, the batch the sweep picks at 64K; attention level at batch 1)
# Each step has its own time limit and writes what it measured even when a later step fails.
#   RESULTS=results/gpu bash scripts/gpu_kernels.sh
# ATTN_LENGTHS / MODEL_LENGTHS / PROFILE_LENGTH / PROFILE_BATCH / DEVICE / LIMIT_S shrink it for a trial
# run on the CPU (the Triton steps then need TRITON_INTERPRET=1).
set -uo pipefail
RESULTS=${RESULTS:-results/gpu}
ATTN_LENGTHS=${ATTN_LENGTHS:-16k,64k,256k}
MODEL_LENGTHS=${MODEL_LENGTHS:-64k,256k,1m}
PROFILE_LENGTH=${PROFILE_LENGTH:-64k}
PROFILE_BATCH=${PROFILE_BATCH:-32}
DEVICE=${DEVICE:-cuda}
LIMIT_S=${LIMIT_S:-150}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"
step() {  # step NAME LIMIT_S COMMAND...: run with a limit, log to $RESULTS/NAME.log
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    echo "== $name: exit $? after ${SECONDS}s"; tail -n 25 "$RESULTS/$name.log"
}
bench=(python3 -c "import sys; from lra.bench.cli import main; sys.exit(main(sys.argv[1:]))")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step check "$LIMIT_S" python3 scripts/device_check.py --device "$DEVICE" --out "$RESULTS/device-check"
common=(--lengths "$ATTN_LENGTHS" --device "$DEVICE" --budget-s 60 --repeats 3 --quiet --no-plot)
step attn-torch "$LIMIT_S" "${bench[@]}" attention --attn full,mita,moba "${common[@]}" --out "$RESULTS/attention-torch"
step attn-triton "$LIMIT_S" "${bench[@]}" attention --attn mita,moba --attn-opt mita.kernel=triton \
    --attn-opt moba.kernel=triton "${common[@]}" --gemm-size 0 --out "$RESULTS/attention-triton"
step model-triton "$((LIMIT_S * 2))" "${bench[@]}" model --attn full,mita --attn-opt mita.kernel=triton \
    --lengths "$MODEL_LENGTHS" --device "$DEVICE" --budget-s 60 --repeats 3 --max-batch 16 --quiet --no-plot \
    --out "$RESULTS/model-triton"
profile=(python3 scripts/profile_step.py --steps 5 --top 20)
step profile-model "$LIMIT_S" "${profile[@]}" --out "$RESULTS/profile-model" model --attn mita \
    --attn-opt mita.kernel=triton --lengths "$PROFILE_LENGTH" --batch "$PROFILE_BATCH" --device "$DEVICE"
step profile-attn "$LIMIT_S" "${profile[@]}" --out "$RESULTS/profile-attention" attention --attn full,mita \
    --attn-opt mita.kernel=triton --lengths "$PROFILE_LENGTH" --device "$DEVICE"
