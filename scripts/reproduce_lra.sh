#!/usr/bin/env bash
# Train every backend on every LRA task whose data is present, then build the tables.
#
#   scripts/reproduce_lra.sh [PRESET] [extra lra-run arguments...]
#
# PRESET: paper (default), cpu or smoke (configs/presets/). Extra arguments go to every lra-run,
# e.g. `scripts/reproduce_lra.sh cpu --set train.threads=2`. Environment (all optional):
#   SEEDS="0 1 2"      seeds per (backend, task)          (default "0")
#   BACKENDS="full mita" backends                         (default: every registered backend)
#   TASKS="listops text" tasks                            (default: all six)
#   DATA_DIR=path      where the task data is             (default ./data; ListOps is generated there)
#   OUT=path           run folders and records            (default ./runs, git-ignored)
#   TABLES=path        tables and plots, of OUT's records (default: tables/ beside OUT, so ./tables)
# The committed reference records live in results/runs; to add to them (the maintainers' runs), set
# OUT=results/runs (TABLES then defaults to results/tables).
# A task whose data `lra-data check` reports missing is skipped with the reason (ListOps is generated
# by lra-run on first use). A run that already has a record is not repeated; an unfinished one
# resumes. A failed or diverged run is reported and the others go on.
set -uo pipefail
cd "$(dirname "$0")/.."

preset="${1:-paper}"
shift || true
out="${OUT:-runs}"
tables="${TABLES:-$(dirname "$out")/tables}"
seeds="${SEEDS:-0}"
tasks="${TASKS:-listops text retrieval image pathfinder pathx}"
backends="${BACKENDS:-$(python -c 'from attentions import list_attentions; print(" ".join(list_attentions()))')}"
data_args=()
if [[ -n "${DATA_DIR:-}" ]]; then
  data_args=(--data-dir "$DATA_DIR")
fi

status="$(lra-data check "${data_args[@]}")" || exit 2
failed=()
skipped=()
for task in $tasks; do
  line="$(grep -E "^${task}[[:space:]]" <<<"$status" || true)"
  if [[ -z "$line" ]]; then
    echo "reproduce_lra: unknown task $task; lra-data check lists: $(cut -d' ' -f1 <<<"$status" | tr '\n' ' ')" >&2
    exit 2
  fi
  if [[ "$line" == *MISSING* && "$task" != listops ]]; then
    echo "reproduce_lra: skipping $task, its data is missing: $(sed -E 's/^[a-z_]+ +MISSING +//' <<<"$line")" >&2
    skipped+=("$task")
    continue
  fi
  for attn in $backends; do
    for seed in $seeds; do
      if [[ -f "$out/${task}_${attn}_${preset}_seed${seed}/record.json" ]]; then
        echo "reproduce_lra: $task/$attn seed $seed already has a record; skipped"
        continue
      fi
      echo "reproduce_lra: lra-run --task $task --attn $attn --preset $preset --seed $seed"
      if ! lra-run --task "$task" --attn "$attn" --preset "$preset" --seed "$seed" --out "$out" "${data_args[@]}" "$@"; then
        failed+=("$task/$attn/seed$seed")
      fi
    done
  done
done

# lra-table leaves smoke runs out of its tables unless asked; here they are what was asked for
table_args=()
if [[ "$preset" == smoke ]]; then
  table_args=(--include-smoke)
fi
lra-table --runs "$out" --out "$tables" "${table_args[@]}"
if (( ${#skipped[@]} )); then
  echo "reproduce_lra: tasks skipped for missing data: ${skipped[*]} (see lra-data check)" >&2
fi
if (( ${#failed[@]} )); then
  echo "reproduce_lra: runs that failed or diverged: ${failed[*]}" >&2
  exit 1
fi
