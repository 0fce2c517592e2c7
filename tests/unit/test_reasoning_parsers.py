"""Reasoning parsers: whole replies against hand-written splits, streamed deltas split at every
boundary and at random chunkings giving the same split, and is_reasoning_end on token ids (single
marker tokens and text-matched markers) against a full rescan."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedllm.reasoning import get_reasoning_parser


def _tokenizer(with_markers: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges: one token per byte, plus <think>/</think> as single
    added tokens when asked."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    if with_markers:
        hf.add_tokens(["<think>", "</think>"], special_tokens=False)
    return hf


TOKENIZERS = {"markers": _tokenizer(True), "bytes": _tokenizer(False)}

# (parser, prompt leaves thinking open, reply, reasoning, content)
CASES = [
    ("deepseek_r1", None, "I should add.</think>The answer is 4.", "I should add.", "The answer is 4."),
    ("deepseek_r1", None, "<think>hm</think>ok", "hm", "ok"),
    ("deepseek_r1", None, "still thinking </thi", "still thinking </thi", None),
    ("deepseek_r1", None, "</think>", None, None),
    ("deepseek_r1", None, "a < b </think> <think> c", "a < b ", " <think> c"),
    ("qwen3", False, "<think>\nlet me see\n</think>\n\nParis.", "\nlet me see\n", "\n\nParis."),
    ("qwen3", False, "Paris, no thinking.", None, "Paris, no thinking."),
    ("qwen3", False, "<thin", None, "<thin"),
    ("qwen3", False, " <think>x</think>", None, " <think>x</think>"),
    ("qwen3", True, "opened by the template</think>answer", "opened by the template", "answer"),
    ("qwen3", True, "never closed", "never closed", None),
]


@pytest.mark.parametrize("name,in_reasoning,reply,reasoning,content", CASES)
def test_whole_reply(name: str, in_reasoning: bool | None, reply: str, reasoning: str | None,
                     content: str | None) -> None:
    p = get_reasoning_parser(name)(TOKENIZERS["markers"])
    assert p.extract_reasoning(reply, in_reasoning) == (reasoning, content)


def _stream(p, in_reasoning, pieces: list[str]) -> tuple[str | None, str | None]:
    s = p.streaming(in_reasoning)
    r, c = [], []
    for piece in pieces + [None]:
        dr, dc = s.feed(piece) if piece is not None else s.finish()
        for acc, d in ((r, dr), (c, dc)):
            assert d != ""  # an empty delta is None
            if d is not None:
                acc.append(d)
    return "".join(r) or None, "".join(c) or None


@pytest.mark.parametrize("name,in_reasoning,reply,reasoning,content", CASES)
def test_streamed_at_every_boundary_and_random_chunks(name, in_reasoning, reply, reasoning, content) -> None:
    p = get_reasoning_parser(name)(TOKENIZERS["markers"])
    for i in range(len(reply) + 1):
        for j in range(i, len(reply) + 1):
            assert _stream(p, in_reasoning, [reply[:i], reply[i:j], reply[j:]]) == (reasoning, content), (i, j)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randint(1, 6))))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        assert _stream(p, in_reasoning, pieces) == (reasoning, content)


def test_no_marker_leaks_into_either_field() -> None:
    p = get_reasoning_parser("deepseek_r1")(TOKENIZERS["markers"])
    s = p.streaming()
    out = [s.feed(x) for x in ["abc</", "thi", "nk", ">d"]] + [s.finish()]
    assert out == [("abc", None), (None, None), (None, None), (None, "d"), (None, None)]


def test_qwen3_enable_thinking_false_and_prompt_state() -> None:
    p = get_reasoning_parser("qwen3")(TOKENIZERS["markers"])
    assert p.reasoning_disabled({"enable_thinking": False}) and not p.reasoning_disabled(None)
    assert p.prompt_in_reasoning("<|im_start|>assistant\n<think>\n") is True
    assert p.prompt_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False
    assert p.prompt_in_reasoning("<|im_start|>assistant\n") is False
    d = get_reasoning_parser("deepseek_r1")(TOKENIZERS["markers"])
    assert d.prompt_in_reasoning("<｜Assistant｜>") is True


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'nope'.*deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("kind", ["markers", "bytes"])
def test_is_reasoning_end_incremental_equals_rescan(kind: str, name: str) -> None:
    tok = TOKENIZERS[kind]
    p = get_reasoning_parser(name)(tok)
    assert (p.start_token_id is not None) == (kind == "markers")
    text = "sys x <think>a</think> user <think> thinking here </think> answer <think> again"
    ids = tok.encode(text, add_special_tokens=False)
    growing: list[int] = []
    for i, t in enumerate(ids):
        growing.append(t)
        prefix = tok.decode(ids[: i + 1])
        e, b = prefix.rfind("</think>"), prefix.rfind("<think>")
        expected = e > b if max(e, b) >= 0 else name == "qwen3"  # no marker: qwen3 is not thinking
        assert p.is_reasoning_end(growing) == expected, prefix
        fresh = get_reasoning_parser(name)(tok)
        assert fresh.is_reasoning_end(list(growing)) == expected
    assert p.is_reasoning_end([]) is False
