"""`pagedllm bench ...`: every benchmark of pagedllm, and the report that turns their results into
docs/benchmarks.md.

The engine benchmarks (throughput, serve, latency, scheduler, memory, collective) each return a
JSON-able dict; `pagedllm/benchmarks_cli.py` parses their flags, prints a table and writes
`--output-json`. The others parse their own flags in `main(argv, prog)` (`commands.py` lists them:
`kernels/` the kernel microbenchmarks, `profiling/` where the time goes, `quant/` the quantization
table, and soak, chaos, gpu-check, host overhead, ...). `report.py` turns the files in
`benchmarks/results/` into `docs/benchmarks.md` and its plots.
"""
