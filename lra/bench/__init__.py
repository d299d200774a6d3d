"""lra-bench: time backends (attention alone, or the whole model) over sequence lengths, with FLOP
rates against the machine's GEMM; cli (the command), sweep, point, measure, workloads, estimate, flops, report,
record (reading a sweep record back)."""
