"""Triton interpreter tests: only collected when TRITON_INTERPRET=1 was set before triton's import
(tests/unit/test_triton_interpreter.py starts them so, in a subprocess)."""

from __future__ import annotations

import os

import numpy as np

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter

    _original_patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope) -> None:
        """Scalars in triton 3.6's interpreter are 1-element arrays, which numpy >= 2.3 no longer
        turns into an int: a loop with run-time bounds would fail there (not on a GPU)."""
        _original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor
