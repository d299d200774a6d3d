#!/usr/bin/env bash
# The GPU checks of the routing kernels and the LRA paper's Table 2, in one run (about 8 minutes on an H200
# for steps 1-4, then at most TABLE2_S seconds):
#   1. scripts/device_check.py: every backend on the GPU vs the CPU, MiTA and MoBA on both kernels
#   2. lra-bench attention: full vs MiTA / MoBA on the PyTorch path, then on the Triton kernels
#   3. lra-bench model (the MiTA paper's setup): full vs MiTA on the Triton kernels
#   4. scripts/profile_step.py: where MiTA's step time goes, by operator and kernel (model level at
#      PROFILE_LENGTH x PROFILE_BATCH, the batch the sweep picks at 64K; attention level at batch 1)
#   5. lra-bench model --preset lra-table2: the LRA paper's Table 2 (every backend's training step on
#      the official Text model at TABLE2_LENGTHS, interleaved with full attention; TABLE2_S seconds at
#      most, each backend TABLE2_BUDGET_S at a length), the same command as on the CPU
# Each step has its own time limit and writes what it measured even when a later step fails;
# status.tsv has one line per step (ok, failed, stopped at its limit), gpu.txt the machine.
#   RESULTS=results/gpu bash scripts/gpu_kernels.sh
# ATTN_LENGTHS / MODEL_LENGTHS / PROFILE_LENGTH / PROFILE_BATCH / TABLE2_LENGTHS / DEVICE / LIMIT_S shrink
# it for a trial run on the CPU (the Triton steps then need TRITON_INTERPRET=1).
set -uo pipefail
RESULTS=${RESULTS:-results/gpu}
ATTN_LENGTHS=${ATTN_LENGTHS:-16k,64k,256k}
MODEL_LENGTHS=${MODEL_LENGTHS:-64k,256k,1m}
PROFILE_LENGTH=${PROFILE_LENGTH:-64k}
PROFILE_BATCH=${PROFILE_BATCH:-32}
DEVICE=${DEVICE:-cuda}
LIMIT_S=${LIMIT_S:-150}
TABLE2_LENGTHS=${TABLE2_LENGTHS:-1k,2k,3k,4k}
TABLE2_S=${TABLE2_S:-240}
TABLE2_BUDGET_S=${TABLE2_BUDGET_S:-30}
LOGS="$RESULTS" STATUS="$RESULTS/status.tsv"
mkdir -p "$RESULTS" && : > "$STATUS" || exit 2
source "$(dirname "$0")/gpu_steps.sh"
bench=("${LRA[@]}" lra-bench)
machine "$RESULTS/gpu.txt"
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
step table2 "$TABLE2_S" "${bench[@]}" model --preset lra-table2 --lengths "$TABLE2_LENGTHS" --device "$DEVICE" \
    --budget-s "$TABLE2_BUDGET_S" --quiet --out "$RESULTS/table2"
