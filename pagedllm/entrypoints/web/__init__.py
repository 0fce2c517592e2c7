"""The web page `pagedllm serve` shows at `/`: a chat playground and a live view of the engine."""
