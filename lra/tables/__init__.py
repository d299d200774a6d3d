"""lra-table: result records -> accuracy, efficiency, taxonomy and throughput tables (Markdown, CSV,
LaTeX) and plots, beside the published numbers; cli (the command), records, format, taxonomy, throughput, plots."""
