"""Where the time goes: `pagedllm bench profile <name>`."""
