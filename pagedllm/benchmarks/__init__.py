"""`pagedllm bench ...`: throughput, serving, latency, scheduler overhead and KV memory benchmarks.

Each benchmark lives in its own module and returns a JSON-able dict; `pagedllm/benchmarks_cli.py`
parses the flags, prints a table and writes `--output-json`. `benchmarks/make_report.py` turns the
JSON files in `benchmarks/results/` into `docs/benchmarks.md` and its plots.
"""
