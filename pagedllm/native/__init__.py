"""pagedllm's native CPU kernels: their C sources (csrc/), the compiler driver and cache (build.py),
one declaration per C entry point (declare.py, kernels.py), and `load`, which gives a library's
typed functions.

    from pagedllm import native
    from pagedllm.native import kernels

    lib = native.load(kernels.LINEAR)   # None: switched off, no compiler, or not for this CPU
    if lib is not None:
        lib.small_m_linear(x_ptr, M, w_ptr, bias_ptr, N, K, y_ptr, dt)

Feature packages keep their own wrappers and policies (pagedllm.attention.cpu_kernel,
pagedllm.layers.native_linear / native_elementwise, pagedllm.quantization.native,
pagedllm.worker.native_decode, the sampler); this package is where every kernel is built and bound.
"""

from __future__ import annotations

import threading

from pagedllm.native.build import AVX2_FORM_FLAGS, CSRC, FLAGS, cache_key, compile_native, cpu_signature, local_includes
from pagedllm.native.declare import Arg, Binding, Kernel, Library, bind

__all__ = ["AVX2_FORM_FLAGS", "CSRC", "FLAGS", "Arg", "Binding", "Kernel", "Library", "bind", "cache_key", "compile_native",
           "cpu_signature", "load", "local_includes"]

_loaded: dict[str, Binding | None] = {}
_lock = threading.Lock()


def load(library: Library) -> Binding | None:
    """The library's kernels (see Binding), built and bound on first use, or None where its switch
    turns it off (read now), it cannot be built here (one warning), or it lacks a required kernel
    (a CPU without the instructions its `#if` guards ask for)."""
    if not library.enabled():
        return None
    try:
        return _loaded[library.source]
    except KeyError:
        pass
    with _lock:
        if library.source not in _loaded:
            cdll = compile_native(CSRC / library.source)
            _loaded[library.source] = None if cdll is None else bind(cdll, library)
        return _loaded[library.source]
