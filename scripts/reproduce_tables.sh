#!/usr/bin/env bash
# Regenerate results/tables/ (Markdown, CSV, LaTeX, plots) from the committed records: the LRA runs in
# results/runs/ (accuracy, efficiency), the MQAR matrix in results/mqar/ (recall) and the lra-bench
# records in results/throughput/ (throughput; the LRA paper's Table 2 from an lra-table2 record).
# No training; takes seconds. Extra arguments go to lra-table, e.g. --attn-module examples/my_attention.py
set -euo pipefail
cd "$(dirname "$0")/.."
exec lra-table --runs results/runs --runs results/mqar --out results/tables "$@"
