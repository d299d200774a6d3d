# Sourced by the GPU scripts (gpu_kernels.sh, gpu_paper_listops.sh): the suite's commands from this
# tree, the machine's description, and steps that run under a time limit and leave one status line.
# The caller sets LOGS (a folder for NAME.log) and STATUS (the status file: step, state, seconds, detail).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# "${LRA[@]}" PROG ARGS...: the console script PROG (lra-run, lra-data, lra-bench, lra-table) of this
# tree, whatever is installed; bad input is one line and exit 2, as from the installed command
LRA=(python3 -c "import importlib, sys
from lra.cli import call
modules = {'lra-run': 'lra.cli.run', 'lra-data': 'lra.cli.data', 'lra-bench': 'lra.bench.cli', 'lra-table': 'lra.tables.cli'}
sys.exit(call(sys.argv[1], importlib.import_module(modules[sys.argv[1]]).main, sys.argv[2:]))")

# machine FILE: the GPU (nvidia-smi), or that there is none, then the host, torch and Triton, into FILE
machine() {
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
          || echo "no GPU (nvidia-smi not found or no device)"
      echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), load $(cut -d' ' -f1-3 /proc/loadavg)"
      python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1 | tail -n 1
    } > "$1"
    cat "$1"
}

# note NAME STATE SECONDS DETAIL: one line of $STATUS (lines this short are appended whole, even
# from steps running at once)
note() {
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STATUS"
}

# detail COMMAND...: the command on one line: "lra-data generate ..." for "${LRA[@]}" lra-data ...,
# and the code of python3 -c shown by its first line only
detail() {
    if [ "$1" = python3 ] && [ "${2:-}" = -c ]; then
        if [ "$3" = "${LRA[2]}" ]; then echo "${*:4}"; else echo "python3 -c '${3%%$'\n'*}...' ${*:4}"; fi
    else
        echo "$*"
    fi
}

# step NAME LIMIT_S COMMAND...: COMMAND under a limit of LIMIT_S seconds (SIGTERM, then SIGKILL 10 s
# later), its output in $LOGS/NAME.log, and its state in $STATUS: ok, failed (exit N) or stopped at
# its limit. A limit under 1 s is 'not run'. Returns the command's exit status.
step() {
    local name=$1 limit=$2; shift 2
    if (( limit < 1 )); then
        note "$name" "not run" 0 "no time left of the script's limit"; echo "== $name: not run, no time left"; return 1
    fi
    echo "== $name (limit ${limit}s): $(detail "$@")"
    local t0=$SECONDS rc state
    timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    case $rc in
        0) state=ok ;; 124|137) state="stopped at its limit (${limit} s)" ;; *) state="failed (exit $rc)" ;;
    esac
    note "$name" "$state" "$((SECONDS - t0))" "$(detail "$@")"
    echo "== $name: $state after $((SECONDS - t0))s"; tail -n 25 "$LOGS/$name.log"
    return $rc
}
