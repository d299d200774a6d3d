#!/usr/bin/env bash
# MiTA's "budget at inference" on MQAR: lra-analyze budget on the trained MiTA, MoBA and Top-k runs of
# scripts/reproduce_mqar.sh, over grids that reach budgets above the trained one, then one table per
# backend over the seeds (lra.analyze.over_seeds).
#
#   scripts/reproduce_mqar_budget.sh
#
# Every finished run of each backend at PRESET and learning rate LR in RUNS (mqar-*_<backend>_<preset>_seed*/,
# every level and seed there; the tuned matrix's other grid points are left out) is analysed into OUT/<its folder name>/ (skipped where its budget.md exists); then
# OUT/mqar_<backend>_<preset>.{md,csv,tex}: each grid cell per level, over the seeds.
# Environment (all optional):
#   RUNS=path             the trained runs                   (default results/mqar)
#   OUT=path              where the analyses go              (default RUNS/budget)
#   PRESET=cpu            the runs' preset                    (default cpu)
#   LR=0.001              the runs' train.lr                  (default 0.001: the untuned protocol's)
#   BACKENDS="mita moba topk"                                the backends analysed
#   EXAMPLES=1000         test examples per cell: the first EXAMPLES of the 3,000 (default 1000;
#                         8,000 to 32,000 queries by level), the trained setting evaluated on the same
#   GRID_mita, GRID_moba, GRID_topk                          a backend's grid (defaults below)
# Needs the lra-analyze command (`pip install -e .` adds it).
set -uo pipefail
cd "$(dirname "$0")/.."

runs="${RUNS:-results/mqar}"
out="${OUT:-$runs/budget}"
preset="${PRESET:-cpu}"
lr="${LR:-0.001}"
backends="${BACKENDS:-mita moba topk}"
examples="${EXAMPLES:-1000}"
# trained at 8 + 8, 2 x 8 and 16 keys per query (configs/attn/*.yaml, tasks.mqar); each grid reaches
# well above that, up to every key of N = 128 for MoBA (16 x 8) and Top-k (128)
GRID_mita="${GRID_mita:-attn.landmarks=4,8,16,32 attn.topk=4,8,16,32,64}"
GRID_moba="${GRID_moba:-attn.block_size=4,8,16 attn.topk=1,2,4,8}"
GRID_topk="${GRID_topk:-attn.topk=4,8,16,32,64,128}"

failed=()
analysed=0
for attn in $backends; do
  grid_var="GRID_$attn"
  grid="${!grid_var:-}"
  if [[ -z "$grid" ]]; then
    echo "reproduce_mqar_budget: no grid for backend $attn; set GRID_$attn, e.g. GRID_$attn=\"attn.topk=8,16,32\"" >&2
    exit 2
  fi
  found=0
  for run in "$runs"/mqar-*_"${attn}_${preset}"_seed*; do
    [[ -f "$run/record.json" && -f "$run/best_model.pt" ]] || continue
    python -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["train"]["lr"] != float(sys.argv[2]))' \
      "$run/config.json" "$lr" || continue
    found=$((found + 1))
    dest="$out/$(basename "$run")"
    if [[ -f "$dest/budget.md" ]]; then
      echo "reproduce_mqar_budget: $dest/budget.md exists; skipped"
      continue
    fi
    echo "reproduce_mqar_budget: lra-analyze budget $run"
    # shellcheck disable=SC2086  # the grid is a list of --set items
    lra-analyze budget "$run" --out "$dest" --examples "$examples" --quiet --set $grid >/dev/null || failed+=("$(basename "$run")")
  done
  if (( found == 0 )); then
    echo "reproduce_mqar_budget: no finished $attn run of preset $preset in $runs (mqar-*_${attn}_${preset}_seed*/ with record.json and best_model.pt); left out (scripts/reproduce_mqar.sh trains it)" >&2
  fi
  analysed=$((analysed + found))
done
if (( analysed == 0 )); then
  echo "reproduce_mqar_budget: no run to analyse in $runs; run scripts/reproduce_mqar.sh first" >&2
  exit 2
fi

python -m lra.analyze.over_seeds "$out" >/dev/null || exit $?
echo "reproduce_mqar_budget: tables over the seeds in $out (mqar_<backend>_$preset.md)"
if (( ${#failed[@]} )); then
  echo "reproduce_mqar_budget: failed: ${failed[*]}" >&2
  exit 1
fi
