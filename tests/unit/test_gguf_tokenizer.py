"""The tokenizer built from a GGUF cuts text as ``tokenizer.ggml.pre`` says.

The oracle is independent of pagedllm and of transformers' conversion: the vocabulary and merges
read with the ``gguf`` package, the text cut with llama.cpp's two regexes for the ``smollm``
pre-tokenizer (each digit alone, then GPT-2's), and textbook byte-level BPE over the merge ranks.
The same comparison against llama.cpp itself is in tests/integration/test_llamacpp_oracle.py.
"""

from __future__ import annotations

import functools
import logging

import pytest

from pagedllm.eval.corpus import default_corpus
from pagedllm.models.loader import resolve_model
from pagedllm.models.loader.gguf_tokenizer import apply_gguf_pre_tokenizer
from pagedllm.models.loader.tokenizer import load_tokenizer

regex = pytest.importorskip("regex")
gguf = pytest.importorskip("gguf")

# llama.cpp's regexes for the smollm pre-tokenizer (applied one after the other, each piece kept);
# its GPT-2 splitter also takes the trailing `\s+` alternative of GPT-2's pattern
DIGIT = regex.compile(r"\p{N}")
GPT2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


class ReferenceBPE:
    """Byte-level BPE from a GGUF's ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``."""

    def __init__(self, path: str) -> None:
        reader = gguf.GGUFReader(path)
        self.pre = str(reader.fields["tokenizer.ggml.pre"].contents())
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        merges = reader.fields["tokenizer.ggml.merges"].contents()
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.byte_char = _bytes_to_unicode()

    def pieces(self, text: str) -> list[str]:
        out = []
        for part in _split_keep(DIGIT, text):
            out.extend(m.group(0) for m in GPT2.finditer(part))
        return out

    @functools.lru_cache(maxsize=None)  # noqa: B019 (one instance per test module)
    def bpe(self, piece: str) -> tuple[int, ...]:
        word = [self.byte_char[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            word[i : i + 2] = [word[i] + word[i + 1]]
        return tuple(self.ids[w] for w in word)

    def encode(self, text: str) -> list[int]:
        return [t for p in self.pieces(text) for t in self.bpe(p)]


def _split_keep(pattern, text: str) -> list[str]:
    """``text`` cut around every match of ``pattern``, matches kept as pieces of their own."""
    out, last = [], 0
    for m in pattern.finditer(text):
        if m.start() > last:
            out.append(text[last : m.start()])
        out.append(m.group(0))
        last = m.end()
    if last < len(text):
        out.append(text[last:])
    return out


@pytest.fixture(scope="module")
def default_gguf() -> str:
    return resolve_model(None).path


@pytest.fixture(scope="module")
def tok(default_gguf: str):
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def reference(default_gguf: str) -> ReferenceBPE:
    return ReferenceBPE(default_gguf)


def test_default_gguf_names_the_smollm_pre_tokenizer(reference: ReferenceBPE, tok) -> None:
    assert reference.pre == "smollm"
    pre = tok.backend_tokenizer.pre_tokenizer
    assert "Digits(individual_digits=True)" in str(pre) and "ByteLevel" in str(pre)


@pytest.mark.parametrize("text,pieces", [
    # the first difference on the corpus: an indented number. GPT-2's regex alone gives
    # "\n  ", " ", "2" (the space before a digit joins " ?\p{N}+"); the model's tokenizer gives "\n   ", "2"
    ("x\n   2 1", ["x", "\n   ", "2", " ", "1"]),
    ("in 1984,", ["in", " ", "1", "9", "8", "4", ","]),
])
def test_digits_are_cut_out_first(tok, reference: ReferenceBPE, text: str, pieces: list[str]) -> None:
    assert reference.pieces(text) == pieces
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text)
    assert [tok.convert_tokens_to_string([t]) for t in tok.convert_ids_to_tokens(ids)] == pieces


def test_corpus_tokenizes_like_the_reference(tok, reference: ReferenceBPE) -> None:
    text = default_corpus().read_text(encoding="utf-8")
    ours = tok.encode(text, add_special_tokens=False)
    ref = reference.encode(text)
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    assert first is None and len(ours) == len(ref), (
        f"first difference at token {first}: {tok.decode(ours[max(0, (first or 0) - 5):(first or 0) + 5])!r}")


class _Backend:
    def __init__(self, pre) -> None:
        self.pre_tokenizer = pre


class _Tok:
    def __init__(self, pre) -> None:
        self.backend_tokenizer = _Backend(pre)


def test_only_gpt2_defaults_are_replaced(caplog) -> None:
    from tokenizers import Regex, pre_tokenizers

    plain = _Tok(pre_tokenizers.ByteLevel(add_prefix_space=False))
    assert apply_gguf_pre_tokenizer(plain, "starcoder") and "Digits" in str(plain.backend_tokenizer.pre_tokenizer)
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    own = _Tok(split)  # transformers already set this name's split: left alone
    assert not apply_gguf_pre_tokenizer(own, "smollm") and own.backend_tokenizer.pre_tokenizer is split
    assert not apply_gguf_pre_tokenizer(_Tok(pre_tokenizers.ByteLevel()), "gpt-2")
    with caplog.at_level(logging.WARNING, logger="pagedllm.models.loader.gguf_tokenizer"):
        assert not apply_gguf_pre_tokenizer(_Tok(pre_tokenizers.ByteLevel()), "some-new-name")
    assert "some-new-name" in caplog.text
