"""lra-sweep: a grid of lra-run runs on submitit's executors (this machine, a SLURM cluster, in-process)."""
