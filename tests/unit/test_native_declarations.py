"""Each kernel declaration of pagedllm.native.kernels against its C function: the prototypes are
read from the library's sources (the C file and everything it includes), and every definition of a
declared function (one per ISA form where a file has several) must have the declaration's number
of arguments, argument names and compatible types, and its return type. The fused decode step's
ctypes structs are checked against their C typedefs the same way. Wrappers call the kernels with
positional arguments (ctypes' cheapest call), one a line, each named in a comment: those names
must be the declaration's, in its order.
"""

from __future__ import annotations

import ctypes
import inspect
import re

import pytest

from pagedllm import native
from pagedllm.attention import cpu_kernel
from pagedllm.layers import native_elementwise, native_linear
from pagedllm.native import kernels
from pagedllm.native.declare import Arg, Kernel, Library
from pagedllm.quantization import native as quant_native

_DEFINITION = re.compile(r"^(?!static\b)([A-Za-z_][\w \t*]*?)\b(\w+)\s*\(([^()]*)\)\s*\{", re.MULTILINE)
_STRUCT = re.compile(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", re.DOTALL)


def _c_text(library: Library) -> str:
    """The library's sources, comments and preprocessor lines removed."""
    text = "\n".join(p.read_text() for p in native.local_includes(native.CSRC / library.source))
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"^\s*#[^\n]*(?:\\\n[^\n]*)*", "", text, flags=re.MULTILINE)


def _split_decl(decl: str) -> tuple[str, str]:
    """'const float *q' -> ('const float *', 'q')."""
    decl = " ".join(decl.split())
    m = re.fullmatch(r"(.*?)(\w+)", decl)
    assert m is not None, decl
    return m.group(1).strip(), m.group(2)


def c_definitions(text: str) -> dict[str, list[tuple[str, list[tuple[str, str]]]]]:
    """name -> [(return type, [(type, name), ...]), one per definition]."""
    found: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {}
    for m in _DEFINITION.finditer(text):
        ret, name, params = " ".join(m.group(1).split()), m.group(2), m.group(3).strip()
        args = [] if params in ("", "void") else [_split_decl(p) for p in params.split(",")]
        found.setdefault(name, []).append((ret, args))
    return found


def compatible(ctype: object, c_type: str) -> bool:
    """Whether a ctypes type passes as this C type (a pointer as any pointer, a struct pointer as a
    pointer to the struct of the same name)."""
    base = " ".join(w for w in c_type.replace("*", " * ").split() if w != "const")
    if ctype is None:
        return base == "void"
    if ctype is ctypes.c_void_p:
        return "*" in base
    if isinstance(ctype, type) and issubclass(ctype, ctypes._Pointer):
        return base.split() == [ctype._type_.__name__, "*"]
    return {ctypes.c_int: "int", ctypes.c_int64: "int64_t", ctypes.c_float: "float",
            ctypes.c_double: "double"}.get(ctype) == base


def mismatches(kernel: Kernel, ret: str, args: list[tuple[str, str]]) -> list[str]:
    """How a declaration differs from one C definition (empty: it matches)."""
    out = []
    if not compatible(kernel.restype, ret):
        out.append(f"returns {ret}, declared {kernel.restype}")
    if len(args) != len(kernel.args):
        out.append(f"{len(args)} arguments in C, {len(kernel.args)} declared")
    for i, (arg, (c_type, c_name)) in enumerate(zip(kernel.args, args)):
        if arg.name != c_name:
            out.append(f"argument {i} is {c_name} in C, declared {arg.name}")
        if not compatible(arg.type, c_type):
            out.append(f"argument {c_name} is {c_type} in C, declared {arg.type.__name__}")
    return out


_ALL = [(lib, k) for lib in kernels.LIBRARIES for k in lib.kernels]


@pytest.mark.parametrize("library, kernel", _ALL, ids=[f"{lib.source}:{k.name}" for lib, k in _ALL])
def test_declaration_matches_the_c_function(library: Library, kernel: Kernel):
    defs = c_definitions(_c_text(library)).get(kernel.name)
    assert defs, f"{kernel.name} is not defined in {library.source} or the files it includes"
    for ret, args in defs:
        assert mismatches(kernel, ret, args) == [], kernel.name


def test_each_entry_point_is_declared_once():
    by_name: dict[str, Kernel] = {}
    for _, k in _ALL:
        assert by_name.setdefault(k.name, k) is k, f"{k.name} declared twice"


def test_a_drifted_declaration_is_caught():
    (ret, args), = c_definitions("int f(const float *x, int64_t n, float *y) {\n}\n")["f"]
    ok = Kernel("f", ctypes.c_int, (Arg("x", ctypes.c_void_p), Arg("n", ctypes.c_int64), Arg("y", ctypes.c_void_p)))
    assert mismatches(ok, ret, args) == []
    assert mismatches(Kernel("f", ctypes.c_int, ok.args[:2]), ret, args)  # an argument missing
    assert mismatches(Kernel("f", ctypes.c_int, (ok.args[0], Arg("n", ctypes.c_int), ok.args[2])), ret, args)
    assert mismatches(Kernel("f", ctypes.c_int, (ok.args[0], Arg("m", ctypes.c_int64), ok.args[2])), ret, args)
    assert mismatches(Kernel("f", None, ok.args), ret, args)


def c_struct_fields(text: str, name: str) -> list[tuple[str, str]]:
    """[(type, field name), ...] of `typedef struct { ... } name;`, with `T a, *b;` split."""
    body = next(m.group(1) for m in _STRUCT.finditer(text) if m.group(2) == name)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        first, *rest = decl.split(",")
        c_type, field = _split_decl(first)
        base = c_type.split("*")[0].strip()
        fields.append((c_type, field))
        for more in rest:  # `*const *post_norm` repeats the base type with its own stars
            stars, field = _split_decl(more)
            fields.append((f"{base} {stars}", field))
    return fields


@pytest.mark.parametrize("struct", [kernels.QuantLinear, kernels.LlamaDecodeModel])
def test_decode_structs_match_their_typedefs(struct: type[ctypes.Structure]):
    fields = c_struct_fields(_c_text(kernels.DECODE), struct.__name__)
    assert [f for _, f in fields] == [name for name, _ in struct._fields_]
    for (c_type, name), (_, ctype) in zip(fields, struct._fields_):
        pointer = "*" in c_type
        assert pointer == (ctype is ctypes.c_void_p or issubclass(ctype, ctypes._Pointer)), name
        if not pointer:
            assert compatible(ctype, c_type), name


def _commented_args(source: str, call: str) -> list[str]:
    """The `# name` comments of a call written one argument per line, in order; a line that unpacks
    several arguments (`*weight,  # codes scales zeros`) names each."""
    start = source.index(call)
    end = source.index("\n    )", start)
    found = re.findall(r"^(\s*\*)?.*,\s*# (\w+(?: \w+)*)$", source[start:end], flags=re.MULTILINE)
    return [name for star, names in found if star or " " not in names for name in names.split()]


_CALLS = [
    (cpu_kernel.paged_attention_native, "lib.paged_attention(", kernels.PAGED_ATTENTION),
    (cpu_kernel.kv_cache_write, "lib.kv_cache_write(", kernels.KV_CACHE_WRITE),
    (cpu_kernel.flash_prefill, "rc = fn(", kernels.FLASH_PREFILL_F32),
    (native_linear.small_m_linear, "lib.small_m_linear(", kernels.SMALL_M_LINEAR),
    (native_elementwise.rms_norm_bf16, "rc = fn(", kernels.RMS_NORM_F32),
    (native_elementwise.rope_bf16, "rc = fn(", kernels.ROPE_F32),
    (quant_native.small_m_linear, "rc = f(", kernels.INT4_LINEAR_BF16),
    (quant_native.w8a8_small_m_linear, ".w8a8_linear(", kernels.W8A8_LINEAR),
    (quant_native.dequantize, ".quant_dequant(", kernels.QUANT_DEQUANT),
    (quant_native.gather_rows, ".quant_gather_rows(", kernels.QUANT_GATHER_ROWS),
]


@pytest.mark.parametrize("wrapper, call, kernel", _CALLS, ids=[f"{w.__module__}.{w.__name__}" for w, _, _ in _CALLS])
def test_wrapper_calls_name_the_arguments_in_order(wrapper, call: str, kernel: Kernel):
    assert _commented_args(inspect.getsource(wrapper), call) == list(kernel.arg_names)


def test_cache_key_follows_included_files():
    """The fused step's build is keyed by the sources it includes, not only its own file."""
    files = {p.name for p in native.local_includes(native.CSRC / kernels.DECODE.source)}
    assert {"llama_decode.c", "paged_attention.c", "small_m_gemm.c", "linear_quant.c", "elementwise_bf16.c",
            "bf16.h", "amx.h"} <= files


def test_no_source_includes_across_folders():
    for path in native.CSRC.iterdir():
        assert '#include "../' not in path.read_text(), path.name


def test_cache_key_changes_with_an_included_header(tmp_path):
    (tmp_path / "k.c").write_text('#include "form.h"\nint k(void) { return F; }\n')
    (tmp_path / "form.h").write_text("#define F 1\n")
    before = native.cache_key(tmp_path / "k.c")
    assert native.cache_key(tmp_path / "k.c") == before
    (tmp_path / "form.h").write_text("#define F 2\n")
    assert native.cache_key(tmp_path / "k.c") != before
