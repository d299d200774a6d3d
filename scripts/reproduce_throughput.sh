#!/usr/bin/env bash
# Throughput as the MiTA paper measures it (Wen et al. 2026, Mixture-of-Top-k Attention), for every
# registered backend, on whatever device is present (one GPU in bf16, else the CPU in float32):
#   1. model level: a 3-layer encoder of width 128 (4 heads, FFN 256), one training step (forward,
#      backward, AdamW) and one inference step at 64K, 256K and 1M tokens, the batch searched per
#      backend and length (doubling from 1 while it fits and gains);
#   2. attention level: one attention call, B=1, H=4, D=32, forward and forward + backward, 1K to 1M.
# Each point runs in its own process with a time budget (--budget-s, 600 s by default); points that
# run out of memory or time are recorded as oom / timeout, full attention too slow to run whole is
# estimated from a slice of its queries (marked ~). Results: results/throughput/<level>-<hardware>/
# (record.json, table.md, throughput.png). On the CPU the whole script takes several hours.
# Extra arguments go to both sweeps, e.g.  scripts/reproduce_throughput.sh --attn full,mita --budget-s 600
set -euo pipefail
cd "$(dirname "$0")/.."

hardware=$(python - <<'PY'
import re, torch
from lra.machine import cpu_model
import os
if torch.cuda.is_available():
    name = torch.cuda.get_device_name(0)
else:
    name = f"{cpu_model()} {len(os.sched_getaffinity(0))}c"
print(re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"))
PY
)

lra-bench model --lengths 64k,256k,1m --out "results/throughput/model-${hardware}" "$@"
lra-bench attention --lengths 1k,4k,16k,64k,256k,1m --out "results/throughput/attention-${hardware}" "$@"
