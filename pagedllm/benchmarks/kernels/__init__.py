"""Kernel microbenchmarks: `pagedllm bench kernels <name>`, each kernel against its torch form or a
previous build."""
