"""Quantization benchmarks: `pagedllm bench quant <name>` (the table of docs/quantization.md)."""
