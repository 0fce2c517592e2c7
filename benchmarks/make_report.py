#!/usr/bin/env python
"""docs/benchmarks.md from benchmarks/results/: the same as `pagedllm bench report` (the generator
lives in pagedllm/benchmarks/report.py)."""

from pagedllm.benchmarks.report import main

if __name__ == "__main__":
    raise SystemExit(main())
