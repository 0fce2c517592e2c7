"""Structured output: constrained decoding with xgrammar or llguidance (see manager.py)."""

from pagedllm.structured_output.backends import choose_backend
from pagedllm.structured_output.manager import (
    StructuredOutputManager,
    StructuredRequest,
    validate_structured_outputs,
)

__all__ = ["StructuredOutputManager", "StructuredRequest", "choose_backend",
           "validate_structured_outputs"]
