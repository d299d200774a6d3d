"""lra-analyze: MiTA's three findings, checked on a finished run.

    budget  RUN_DIR   test accuracy with attention options changed at inference (cli.py, budget.py)
    tokens  RUN_DIR   which keys the landmarks select into routed experts, per layer (tokens.py)

The swap-in finding is a training run: ``lra-run ... --init-from RUN_DIR`` (lra/run/init_from.py).
"""
