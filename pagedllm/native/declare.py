"""Declarations of C entry points, and the ctypes bindings built from them.

Each C function Python calls is declared once, as a `Kernel`: its name, return type and arguments
(`Arg`: name and ctypes type), in the order and with the names of the C prototype (a test reads the
C sources and checks every declaration against its function). A `Library` is one C file of
`pagedllm/native/csrc`, the kernels it exports, and the switch that turns it off. `bind` types each
kernel's ctypes function once; callers then call those functions directly with positional
arguments, the cheapest call ctypes has (no wrapper and no keyword handling per call), written one
a line with the C argument's name in a comment, or a run of arguments several kernels share
unpacked from one tuple with each name in its comment (tests/unit/test_native_declarations.py
checks the names against the declaration).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

# Argument and return types. Every pointer is passed as an address (`tensor.data_ptr()`, a numpy
# array's `.ctypes.data`, None for NULL) except struct pointers, declared with their ctypes type.
PTR = ctypes.c_void_p
I32 = ctypes.c_int
I64 = ctypes.c_int64
F32 = ctypes.c_float
VOID = None


@dataclass(frozen=True)
class Arg:
    name: str
    type: Any  # a ctypes type


def ptr(name: str) -> Arg:
    return Arg(name, PTR)


def i32(name: str) -> Arg:
    return Arg(name, I32)


def i64(name: str) -> Arg:
    return Arg(name, I64)


def f32(name: str) -> Arg:
    return Arg(name, F32)


@dataclass(frozen=True)
class Kernel:
    """One C entry point: `restype name(args...)`. `required`: a library lacking it is not used
    (a CPU without the instructions its `#if` guards ask for); else it is bound where present."""

    name: str
    restype: Any
    args: tuple[Arg, ...] = ()
    required: bool = True

    @property
    def argtypes(self) -> list[Any]:
        return [a.type for a in self.args]

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)


@dataclass(frozen=True)
class Library:
    """One C file of pagedllm/native/csrc and the kernels Python calls in it. `enabled` reads its
    switch (an environment variable, through pagedllm.envs) at each load."""

    source: str
    kernels: tuple[Kernel, ...]
    enabled: Callable[[], bool] = lambda: True


class Binding:
    """A loaded library: one attribute per kernel present in it (its typed ctypes function), and
    `cdll`, the library itself."""

    def __init__(self, cdll: ctypes.CDLL, kernels: tuple[Kernel, ...]) -> None:
        self.cdll = cdll
        for k in kernels:
            if hasattr(cdll, k.name):
                f = getattr(cdll, k.name)
                f.argtypes, f.restype = k.argtypes, k.restype
                setattr(self, k.name, f)

    def __repr__(self) -> str:
        return f"Binding({self.cdll._name})"


def bind(cdll: ctypes.CDLL, library: Library) -> Binding | None:
    """The library's kernels typed, or None where it lacks a required one."""
    if not all(hasattr(cdll, k.name) for k in library.kernels if k.required):
        return None
    return Binding(cdll, library.kernels)
