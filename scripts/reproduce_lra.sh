#!/usr/bin/env bash
# Train every backend on every LRA task whose data is present (an lra-sweep), then build the tables.
#
#   scripts/reproduce_lra.sh [PRESET] [more lra-sweep run arguments...]
#
# PRESET: paper (default), cpu or smoke (configs/presets/). More arguments go to `lra-sweep run`, e.g.
# `scripts/reproduce_lra.sh paper --executor slurm --partition gpu --gpus-per-run 1` or
# `scripts/reproduce_lra.sh cpu --parallel 2`. Environment (all optional):
#   SEEDS="0 1 2"        seeds per (backend, task)          (default "0")
#   BACKENDS="full mita" backends                           (default: every registered backend)
#   TASKS="listops text" tasks                              (default: all six)
#   DATA_DIR=path        where the task data is             (default ./data; ListOps is generated there)
#   OUT=path             the sweep's folder                 (default ./runs)
#   TABLES=path          tables and plots of OUT's records  (default: tables/ beside OUT, so ./tables)
# A task whose data `lra-data check` reports missing is left out with the reason (ListOps is generated
# by lra-run on first use). lra-sweep skips finished runs and resumes stopped ones, so running the
# script again continues it; `lra-sweep status OUT` says where each run stands.
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
present=()
for task in $tasks; do
  line="$(grep -E "^${task}[[:space:]]" <<<"$status" || true)"
  if [[ -z "$line" ]]; then
    echo "reproduce_lra: unknown task $task; lra-data check lists: $(cut -d' ' -f1 <<<"$status" | tr '\n' ' ')" >&2
    exit 2
  fi
  if [[ "$line" == *MISSING* && "$task" != listops ]]; then
    echo "reproduce_lra: leaving out $task, its data is missing: $(sed -E 's/^[a-z_]+ +MISSING +//' <<<"$line")" >&2
    continue
  fi
  present+=("$task")
done
if (( ${#present[@]} == 0 )); then
  echo "reproduce_lra: no task has its data; see lra-data check" >&2
  exit 2
fi

join() { local IFS=,; echo "$*"; }
lra-sweep run --task "$(join "${present[@]}")" --attn "$(join $backends)" --seeds "$(join $seeds)" \
  --preset "$preset" --out "$out" "${data_args[@]}" "$@"
code=$?
if (( code == 2 )); then
  exit 2
fi
lra-sweep table "$out" --out "$tables" || exit $?
exit "$code"
