#!/usr/bin/env bash
# MiTA's three findings on the ListOps cpu-preset runs -> results/analyses/ (docs/analyses.md).
#
#   scripts/reproduce_analyses.sh
#
# For each seed S (needs RUNS/listops_mita_cpu_seedS and RUNS/listops_full_cpu_seedS, each with its
# best_model.pt):
#   1. budget:  lra-analyze budget on the MiTA run over GRID          -> OUT/budget/listops_mita_cpu_seedS/
#   2. tokens:  lra-analyze tokens on the MiTA run                     -> OUT/tokens/listops_mita_cpu_seedS/
#   3. swap-in: MiTA started from the full run's weights (lra-run --init-from), evaluated as is
#               (train.steps=0) and after a FINETUNE_STEPS-step fine-tune at the cpu preset
#                                                                      -> OUT/swapin/steps0/, OUT/swapin/steps<N>/
# then OUT/swapin/swapin.{md,csv,tex}: per seed, full, MiTA trained alone, MiTA swapped in, and fine-tuned.
# What exists is skipped: an analysis whose .md is there, a run with its record.json (an unfinished
# run resumes). Environment (all optional):
#   SEEDS="0 1 2"             seeds                                  (default "0 1 2")
#   RUNS=path                 the trained runs    (default results/analyses/runs: the committed analyses' own)
#   OUT=path                  where the analyses go                  (default results/analyses)
#   DATA_DIR=path             the data folder                        (default: each run's own data.data_dir)
#   GRID="attn.landmarks=16,32,64,128 attn.topk=16,32,64,128"        the budget grid (default this)
#   FINETUNE_STEPS=300        fine-tuning steps of the swap-in        (default 300)
#   PRESET=cpu                the runs' preset                       (default cpu; smoke tries the script out)
#   RUN_SETS="k=v ..."        more --set items for the swap-in runs  (e.g. the tiny model of a smoke try-out)
# Needs the lra-analyze command (`pip install -e .` adds it).
set -uo pipefail
cd "$(dirname "$0")/.."

seeds="${SEEDS:-0 1 2}"
runs="${RUNS:-results/analyses/runs}"
out="${OUT:-results/analyses}"
grid="${GRID:-attn.landmarks=16,32,64,128 attn.topk=16,32,64,128}"
steps="${FINETUNE_STEPS:-300}"
preset="${PRESET:-cpu}"
# shellcheck disable=SC2206  # a list of --set items
run_sets=(${RUN_SETS:-})
data_args=()
if [[ -n "${DATA_DIR:-}" ]]; then
  data_args=(--data-dir "$DATA_DIR")
fi

failed=()
for seed in $seeds; do
  mita="$runs/listops_mita_${preset}_seed$seed"
  full="$runs/listops_full_${preset}_seed$seed"
  # shellcheck disable=SC2086  # GRID is a list of --set items
  for what in budget tokens; do
    dest="$out/$what/listops_mita_${preset}_seed$seed"
    if [[ -f "$dest/$what.md" ]]; then
      echo "reproduce_analyses: $dest/$what.md exists; skipped"
      continue
    fi
    args=()
    [[ "$what" == budget ]] && args=(--set $grid)
    echo "reproduce_analyses: lra-analyze $what $mita"
    lra-analyze "$what" "$mita" --out "$dest" --quiet "${data_args[@]}" "${args[@]}" || failed+=("$what/seed$seed")
  done
  for n in 0 "$steps"; do
    dest="$out/swapin/steps$n"
    if [[ -f "$dest/listops_mita_${preset}_seed${seed}_from-listops_full_${preset}_seed$seed/record.json" ]]; then
      echo "reproduce_analyses: swap-in seed $seed, $n steps, has a record; skipped"
      continue
    fi
    echo "reproduce_analyses: lra-run --attn mita --preset $preset --seed $seed --init-from $full --set train.steps=$n"
    lra-run --task listops --attn mita --preset "$preset" --seed "$seed" --init-from "$full" --out "$dest" --quiet \
      "${data_args[@]}" --set "${run_sets[@]}" "train.steps=$n" || failed+=("swapin/steps$n/seed$seed")
  done
done

python - "$runs" "$out/swapin" "$steps" "$preset" $seeds <<'EOF'
"""The swap-in table: test accuracy of full, MiTA trained alone, MiTA on full's weights, and fine-tuned."""
import json
import statistics
import sys
from pathlib import Path

from lra.format import MISSING, Table, write_tables

runs, swapin, steps, preset, seeds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]


def acc(path):
    try:
        value = json.loads(path.read_text())["test_acc"]
    except (OSError, ValueError, KeyError):
        return None
    return None if value is None else 100 * value


columns = ["seed", "full", "mita (trained alone)", "mita on full's weights, 0 steps", f"... after {steps} steps"]
values = []
for seed in seeds:
    swapped = f"listops_mita_{preset}_seed{seed}_from-listops_full_{preset}_seed{seed}/record.json"
    values.append([acc(runs / f"listops_full_{preset}_seed{seed}" / "record.json"),
                   acc(runs / f"listops_mita_{preset}_seed{seed}" / "record.json"),
                   acc(swapin / "steps0" / swapped), acc(swapin / f"steps{steps}" / swapped)])
cell = lambda v: MISSING if v is None else f"{v:.2f}%"
rows = [[seed, *map(cell, vs)] for seed, vs in zip(seeds, values)]
means = [[v for v in col if v is not None] for col in zip(*values)]
spread = lambda c: f"{statistics.fmean(c):.2f} ± {statistics.stdev(c):.2f}%" if len(c) > 1 else cell(c[0])
rows.append(["mean ± std", *(spread(c) if c else MISSING for c in means)])
records = [{"seed": seed, **dict(zip(["full", "mita", "swapin_0", f"swapin_{steps}"], vs))} for seed, vs in zip(seeds, values)]
table = Table(f"Swap-in: MiTA on full attention's trained weights (ListOps, {preset} preset), test accuracy", columns, rows,
              notes=[f"lra-run --attn mita --preset {preset} --init-from <full run> --set train.steps=0 / {steps}; "
                     "scripts/reproduce_analyses.sh."], records=records)
written = write_tables(swapin, "swapin", [table])
print(Path(written[0]).read_text())
EOF

if (( ${#failed[@]} )); then
  echo "reproduce_analyses: failed: ${failed[*]}" >&2
  exit 1
fi
