"""lra-sweep: a grid of lra-run runs on one machine or a SLURM cluster, its status and its tables.

    lra-sweep run    --task listops,text --attn full,mita --seeds 0,1,2 --preset cpu --out runs/sweep
                     [--set train.lr=1e-3,3e-4] [--spec sweep.yaml] --executor local|slurm|debug ...
    lra-sweep status runs/sweep
    lra-sweep table  runs/sweep [--out runs/sweep/tables]
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..errors import UserError
from ..files import FolderLock
from ..format import plural
from . import spec as specs
from .folder import SweepFolder

EPILOG = (
    "examples: lra-sweep run --task listops --attn full,mita --seeds 0,1,2 --preset cpu --executor local "
    "--out runs/sweep | lra-sweep run --spec sweep.yaml --executor slurm --partition gpu --gpus-per-run 1 "
    "--out runs/lra | lra-sweep status runs/sweep | lra-sweep table runs/sweep"
)


def parser() -> Any:
    from ..cli import Parser

    p = Parser(prog="lra-sweep", description="Run a grid of lra-run runs (tasks x backends x seeds x presets x --set "
               "values) on this machine or a SLURM cluster, through submitit; report and tabulate them.", epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="{run,status,table}")
    run = sub.add_parser("run", help="submit (or continue) a sweep", epilog=EPILOG,
                         description="Expand the grid, then submit each run not finished, running or queued. "
                         "Re-running the same command continues the sweep: finished runs are skipped, stopped ones resume.")
    run.add_argument("--out", required=True, help="the sweep's folder: the run folders, and sweep/ with the spec, "
                     "run list, states and logs")
    run.add_argument("--spec", metavar="FILE.yaml", help="the grid as YAML (keys: task, attn, seeds, preset, set, "
                     "extra, data_dir, configs, attn_modules) instead of the axis flags")
    run.add_argument("--task", help="comma-separated tasks, e.g. listops,text")
    run.add_argument("--attn", help="comma-separated backends, e.g. full,mita")
    run.add_argument("--seeds", help="comma-separated seeds (default 0)")
    run.add_argument("--preset", help="comma-separated presets (default paper)")
    run.add_argument("--set", dest="sets", nargs="+", action="extend", default=[], metavar="KEY=V1[,V2...]",
                     help="config values, each an axis of the grid, e.g. train.lr=1e-3,3e-4 attn.topk=32")
    run.add_argument("--tune", nargs="+", action="extend", default=[], metavar="KEY=V1[,V2...]",
                     help="values to tune, e.g. train.lr=3e-4,1e-3,3e-3,1e-2: every combination runs at the first "
                     "seed for each cell (task x backend x preset x --set values); the other seeds run at the one "
                     "--select chose there (ties: the smaller value)")
    run.add_argument("--select", help="what chooses among the tuned values (default and only: val_acc, the best "
                     "validation accuracy)")
    run.add_argument("--data-dir", help="lra-run --data-dir for every run")
    run.add_argument("--config", dest="configs", action="append", default=[], metavar="FILE.yaml",
                     help="lra-run --config for every run (may repeat)")
    run.add_argument("--attn-module", action="append", default=[], metavar="FILE.py",
                     help="lra-run --attn-module for every run (may repeat)")
    run.add_argument("--executor", choices=("local", "slurm", "debug"), default="local",
                     help="local: this machine, --parallel runs at once (waits); slurm: a job array on the cluster "
                     "(returns once queued); debug: one run after another in this process (default local)")
    run.add_argument("--parallel", type=int, help="local: runs at once (default: the cores / --cpus-per-run)")
    run.add_argument("--cpus-per-run", type=int, default=1, help="cores (and torch threads) per run (default 1)")
    run.add_argument("--time", dest="time_min", type=int, default=24 * 60, metavar="MINUTES",
                     help="a job's time limit; a run stopped by it checkpoints and is requeued (default 1440)")
    run.add_argument("--partition", help="slurm: the partition")
    run.add_argument("--gpus-per-run", type=int, default=0, help="GPUs per run (default 0); local: each run sees its "
                     "own GPUs (CUDA_VISIBLE_DEVICES), 0 = every run sees them all")
    run.add_argument("--mem-gb", type=float, help="slurm: memory per run, in GB")
    run.add_argument("--array-parallelism", type=int, default=256, help="slurm: array tasks running at once (default 256)")
    run.add_argument("--account", help="slurm: the account to charge")
    run.add_argument("--qos", help="slurm: the quality of service")
    run.add_argument("--constraint", help="slurm: node features, e.g. a100")
    run.add_argument("--slurm-extra", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                     help="slurm: any other submitit SLURM parameter, e.g. exclude=node3 signal_delay_s=120")
    run.add_argument("--dry-run", action="store_true", help="list the runs that would be submitted; write nothing")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    status = sub.add_parser("status", help="one line per run and a summary",
                            description="Where each run of a sweep stands: pending, running (step and ETA), "
                            "finished (test accuracy), diverged or failed (the error and the log).")
    status.add_argument("folder", metavar="DIR", help="the sweep's --out folder")
    table = sub.add_parser("table", help="lra-table over the sweep's runs",
                           description="Build the tables and plots of the sweep's finished runs as lra-table does: "
                                       "accuracy and efficiency, and the recall table of MQAR runs.")
    table.add_argument("folder", metavar="DIR", help="the sweep's --out folder")
    table.add_argument("--out", help="where to write them (default DIR/tables)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "status":
        return status_main(args)
    if args.command == "table":
        return table_main(args)
    return run_main(args)


def spec_of(args: Any, folder: SweepFolder) -> specs.SweepSpec:
    """The sweep's spec: --spec, the axis flags, or (neither given) the one the folder already holds."""
    axis_flags = any(v is not None for v in (args.task, args.attn, args.seeds, args.preset, args.select)) or args.sets \
        or args.tune
    if args.spec and axis_flags:
        raise UserError("give the grid either as --spec FILE.yaml or as --task/--attn/--set flags, not both")
    if args.spec:
        return specs.from_yaml(args.spec)
    if axis_flags:
        if args.task is None or args.attn is None:
            raise UserError("a grid needs --task and --attn (and optionally --seeds, --preset, --set); or give --spec")
        return specs.from_flags(args.task, args.attn, args.seeds or "0", args.preset or "paper", args.sets,
                                args.data_dir, args.configs, args.attn_module, args.tune, args.select)
    if folder.exists():
        try:
            return specs.from_yaml(str(folder.spec_file), origin=f"the sweep's spec {folder.spec_file}")
        except UserError as err:
            raise UserError(f"{err}; delete {folder.meta} (the run folders beside it stay) and give the grid "
                            "again, as --task/--attn or --spec")
    raise UserError("no grid given: give --task and --attn (or --spec FILE.yaml), or the --out of an existing sweep")


def run_argv(out: str, run: specs.RunSpec, spec: specs.SweepSpec) -> List[str]:
    """The lra-run flags of one run."""
    argv = ["--task", run.task, "--attn", run.attn, "--preset", run.preset, "--seed", str(run.seed), "--out", out, "--quiet"]
    if spec.data_dir is not None:
        argv += ["--data-dir", spec.data_dir]
    for path in spec.configs:
        argv += ["--config", path]
    for path in spec.attn_modules:
        argv += ["--attn-module", path]
    if run.sets:
        argv += ["--set", *run.sets]
    if run.tuning:
        argv += ["--tuning", run.tuning]
    return argv


def check_numbers(args: Any) -> None:
    for flag, value, low in (("--parallel", args.parallel, 1), ("--cpus-per-run", args.cpus_per_run, 1),
                             ("--time", args.time_min, 1), ("--gpus-per-run", args.gpus_per_run, 0),
                             ("--array-parallelism", args.array_parallelism, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    if args.mem_gb is not None and not args.mem_gb > 0:
        raise UserError(f"--mem-gb must be a positive number of GB, got {args.mem_gb}")
    if args.executor != "local" and args.parallel is not None:
        raise UserError(f"--parallel is for --executor local; with {args.executor} "
                        + ("--array-parallelism caps the runs at once" if args.executor == "slurm" else "runs go one at a time"))


def slurm_options(args: Any) -> Any:
    from .launch import SlurmOptions

    extra: Dict[str, Any] = {}
    for item in args.slurm_extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--slurm-extra {item!r} must look like KEY=VALUE, e.g. exclude=node3")
        extra[key] = yaml_value(value)
    return SlurmOptions(partition=args.partition, gpus_per_run=args.gpus_per_run, cpus_per_run=args.cpus_per_run,
                        mem_gb=args.mem_gb, time_min=args.time_min, array_parallelism=args.array_parallelism,
                        account=args.account, qos=args.qos, constraint=args.constraint, extra=extra)


def yaml_value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def run_main(args: Any) -> int:
    from .launch import local_slots, run_debug, run_local, slurm_executor, submit_slurm, to_submit

    check_numbers(args)
    folder = SweepFolder(Path(args.out))
    spec = spec_of(args, folder)
    specs.check_runs(spec, spec.runs())
    options = slurm_options(args) if args.executor == "slurm" else None
    slots = None
    if args.executor == "local":
        slots = local_slots(args.parallel, args.cpus_per_run, args.gpus_per_run)
    if options is not None and shutil.which("sbatch") is None:
        raise UserError("--executor slurm needs SLURM's sbatch on PATH (run on a cluster's login node); "
                        "on one machine use --executor local")
    if options is not None:
        # an option submitit does not know fails here, before anything is written
        slurm_executor(SweepFolder(Path(os.devnull)), options)
    if args.dry_run:
        return dry_run(folder, spec)
    new = [p for p in (folder.out, folder.meta) if not p.exists()]
    try:
        folder.out.mkdir(parents=True, exist_ok=True)
        folder.meta.mkdir(exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {folder.out}: cannot create the folder ({err.strerror})")
    lock = FolderLock(folder.meta)
    lock.acquire(wait=False, busy="{folder} is in use by another lra-sweep run (pid {pid}); wait for it, or follow "
                 "it with lra-sweep status")
    with lock:
        try:
            runs = plan(folder, spec)
            todo, left = to_submit(folder)
            if todo and args.executor == "slurm":
                ids = submit_slurm(folder, todo, options)
        except UserError:
            # refused before any run was submitted: a sweep folder this command made goes again
            for path in reversed(new):
                shutil.rmtree(path, ignore_errors=True)
            raise
        kept = ", ".join(f"{n} {state}" for state, n in sorted(left.items()))
        waiting = len(spec.undecided(tuned(folder, spec)))
        print(f"lra-sweep: {plural(len(runs) + waiting, 'run')}; {len(todo)} to run" + (f" ({kept} left as they are)" if kept else "")
              + (f"; {waiting} wait for their cell's tuning grid" if waiting else ""), file=sys.stderr)
        if not todo:
            return 0
        if args.executor == "slurm":
            jobs = f"job {ids[0]}" if len(ids) == 1 else f"jobs {ids[0]}..{ids[-1]}"
            print(f"lra-sweep: submitted {plural(len(ids), 'run')} to SLURM ({jobs}); follow them with "
                  f"lra-sweep status {folder.out}"
                  + (f"; once a cell's tuning grid has finished, the same lra-sweep run command submits its other seeds"
                     if waiting else ""))
            return 0
        # a tuned sweep's other seeds join the queue as each cell's grid finishes
        refill = (lambda: next_runs(folder, spec, todo)) if spec.tune is not None else None
        if args.executor == "local":
            outcomes = run_local(folder, todo, slots, args.time_min, args.quiet, refill)
        else:
            outcomes = run_debug(folder, todo, args.quiet, args.cpus_per_run, refill)
    from .status import report

    print(report(folder))
    return 0 if all(o == "completed" for o in outcomes.values()) else 1


def tuned(folder: SweepFolder, spec: specs.SweepSpec) -> specs.Decided:
    """A tuned sweep's decided cells (lra/sweep/tune.py); {} for a sweep without tuning."""
    from .tune import decided

    return decided(folder, spec) if spec.tune is not None else {}


def plan(folder: SweepFolder, spec: specs.SweepSpec) -> List[specs.RunSpec]:
    """The runs the spec names now (a tuned sweep's: the grid, and the other seeds of its decided cells),
    written to the sweep's run list."""
    runs = spec.runs(tuned(folder, spec))
    folder.write(spec, runs, [run_argv(str(folder.out), run, spec) for run in runs])
    return runs


def next_runs(folder: SweepFolder, spec: specs.SweepSpec, submitted: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Runs that a finished grid has added to a tuned sweep, not yet among ``submitted`` (which grows)."""
    from .launch import to_submit

    plan(folder, spec)
    seen = {run["key"] for run in submitted}
    new = [run for run in to_submit(folder)[0] if run["key"] not in seen]
    submitted.extend(new)
    return new


def dry_run(folder: SweepFolder, spec: specs.SweepSpec) -> int:
    """Print every lra-run command the sweep would run, and how many; a tuned sweep's runs that wait for
    their cell's choice carry ``<chosen>`` in place of the tuned values."""
    decided = tuned(folder, spec) if folder.exists() else {}
    runs = spec.runs(decided)
    waiting = spec.undecided(decided)
    for run in runs + waiting:
        print(f"lra-run {shlex.join(run_argv(str(folder.out), run, spec))}")
    if spec.tune is None:
        print(plural(len(runs), "run"))
        return 0
    grid = sum(1 for r in runs if r.seed == spec.tune.seed and r.tuning)
    chosen = len(runs) - grid - len(spec.extra)
    others = ", ".join(str(s) for s in spec.seeds if s != spec.tune.seed) or "none"
    print(f"{plural(len(runs) + len(waiting), 'run')}: {grid} on the tuning grid ({spec.tune.describe()}), "
          f"{chosen + len(waiting)} at each cell's chosen values (seeds {others}; {len(waiting)} still to be chosen)"
          + (f", {len(spec.extra)} extra" if spec.extra else ""))
    return 0


def status_main(args: Any) -> int:
    from .status import report

    folder = SweepFolder(Path(args.folder))
    folder.require()
    print(report(folder))
    return 0


def table_main(args: Any) -> int:
    from ..tables.cli import main as table

    folder = SweepFolder(Path(args.folder))
    folder.require()
    saved = folder.saved_spec()
    presets = saved.get("preset") or []
    extra = [r.get("preset") for r in saved.get("extra") or [] if isinstance(r, dict)]
    argv = ["--runs", str(folder.out), "--out", args.out or str(folder.out / "tables"),
            "--throughput", str(folder.meta / "throughput")]
    if "smoke" in list(presets) + extra:
        argv.append("--include-smoke")
    return table(argv)


def entry() -> None:
    from ..cli import console

    console("lra-sweep", main)


if __name__ == "__main__":
    entry()
