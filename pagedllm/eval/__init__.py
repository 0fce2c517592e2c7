"""Quality checks: perplexity with llama.cpp's convention."""

from __future__ import annotations

from pagedllm.eval.perplexity import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "perplexity"]
