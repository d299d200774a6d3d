#!/usr/bin/env bash
# The MQAR matrix on a CPU (an lra-sweep): every backend at the mqar cpu preset, at each number of
# key-value pairs, over seeds; then the recall table and plot (lra-table).
#
#   scripts/reproduce_mqar.sh [more lra-sweep run arguments...]
#
# e.g. `scripts/reproduce_mqar.sh --parallel 2` (every backend at the config's learning rate: 198 runs)
# or `scripts/reproduce_mqar.sh --executor slurm --partition cpu`. The committed matrix tunes the
# learning rate of each backend and level: `lra-sweep run --spec sweeps/mqar_cpu_tuned.yaml`.
# Environment (all optional):
#   SEEDS="0 1 2"        seeds per (backend, level)          (default "0 1 2")
#   PAIRS="8 16 32"      the levels: data.pairs              (default "8 16 32"; at most 42 at N = 128)
#   BACKENDS="full mita" backends                            (default: every registered backend)
#   PRESET=cpu           the mqar preset                     (default cpu; smoke tries the script out)
#   OUT=path             the sweep's folder                  (default ./runs/mqar)
#   TABLES=path          the tables and plots                (default OUT/tables)
# Nothing is read from disk: MQAR examples are generated from (seed, index). lra-sweep skips finished
# runs and resumes stopped ones, so running the script again continues it.
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-runs/mqar}"
tables="${TABLES:-$out/tables}"
seeds="${SEEDS:-0 1 2}"
pairs="${PAIRS:-8 16 32}"
preset="${PRESET:-cpu}"
backends="${BACKENDS:-$(python -c 'from attentions import list_attentions; print(" ".join(list_attentions()))')}"

join() { local IFS=,; echo "$*"; }
lra-sweep run --task mqar --attn "$(join $backends)" --seeds "$(join $seeds)" --preset "$preset" \
  --set "data.pairs=$(join $pairs)" --out "$out" "$@"
code=$?
if (( code == 2 )); then
  exit 2
fi
lra-sweep table "$out" --out "$tables" || exit $?
exit "$code"
