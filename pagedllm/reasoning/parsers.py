"""The `<think>...</think>` reasoning parsers (deepseek_r1, qwen3)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest proper suffix of `text` that is a prefix of `marker` (a marker that may
    be completed by the next chunk)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class _Scan:
    """How far `is_reasoning_end` has read one token list, and what it found."""

    __slots__ = ("pos", "first", "last", "ended", "tail")

    def __init__(self) -> None:
        self.pos = 0
        self.first: int | None = None
        self.last: int | None = None
        self.ended = False
        self.tail = ""


class ReasoningParser:
    """Thinking between `start_text` and `end_text`. Built from the tokenizer pagedllm uses (the
    Hugging Face tokenizer, or pagedllm's TokenizerWrapper around one)."""

    name = ""
    start_text = "<think>"
    end_text = "</think>"
    starts_in_reasoning = False
    """True when a reply starts inside the thinking whatever the prompt (deepseek_r1)."""
    honours_enable_thinking = False
    """True when chat_template_kwargs {"enable_thinking": false} means the reply has no thinking."""
    _CACHE = 512

    def __init__(self, tokenizer: Any) -> None:
        hf = getattr(tokenizer, "hf", tokenizer)
        self._hf = hf
        vocab = hf.get_vocab()
        self.start_token_id: int | None = vocab.get(self.start_text)
        self.end_token_id: int | None = vocab.get(self.end_text)
        self._scans: OrderedDict[int, _Scan] = OrderedDict()

    # ---- token ids (the engine core) ----------------------------------------------------------
    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """Whether `token_ids` (a prompt, or a prompt and the reply so far) are past the thinking:
        the last think marker is `</think>`; with no marker at all, False for a parser whose replies
        start inside the thinking (deepseek_r1), True otherwise (qwen3: a reply thinks only when
        `<think>` opens it). Called again on the same growing list, it reads only the new tokens: the
        list's progress is remembered by its identity (checked against its first and last read
        token), so the cost is O(new tokens) amortised."""
        n = len(token_ids)
        if n == 0:
            return False
        key = id(token_ids)
        st = self._scans.get(key)
        if st is None or st.pos > n or token_ids[0] != st.first or token_ids[st.pos - 1] != st.last:
            st = _Scan()
            st.first = token_ids[0]
            st.ended = not self.starts_in_reasoning
        if self.start_token_id is not None and self.end_token_id is not None:
            for t in token_ids[st.pos:n]:
                if t == self.end_token_id:
                    st.ended = True
                elif t == self.start_token_id:
                    st.ended = False
        else:
            keep = max(len(self.start_text), len(self.end_text)) - 1
            for t in token_ids[st.pos:n]:
                s = st.tail + self._hf.decode([t], skip_special_tokens=False)
                e, b = s.rfind(self.end_text), s.rfind(self.start_text)
                if e > b:
                    st.ended = True
                elif b > e:
                    st.ended = False
                st.tail = s[-keep:]
        st.pos, st.last = n, token_ids[n - 1]
        self._scans[key] = st
        self._scans.move_to_end(key)
        while len(self._scans) > self._CACHE:
            self._scans.popitem(last=False)
        return st.ended

    # ---- text (the chat server) ----------------------------------------------------------------
    def prompt_in_reasoning(self, prompt_text: str | None, template_kwargs: dict[str, Any] | None = None) -> bool:
        """Whether a reply to this prompt starts inside the thinking."""
        if self.honours_enable_thinking and (template_kwargs or {}).get("enable_thinking") is False:
            return False
        if self.starts_in_reasoning:
            return True
        text = prompt_text or ""
        return text.rfind(self.start_text) > text.rfind(self.end_text)

    def reasoning_disabled(self, template_kwargs: dict[str, Any] | None) -> bool:
        """True when the request turned thinking off (qwen3's enable_thinking=false): no split."""
        return self.honours_enable_thinking and (template_kwargs or {}).get("enable_thinking") is False

    def streaming(self, in_reasoning: bool | None = None) -> ReasoningStream:
        """A per-request extractor; `in_reasoning`: the prompt left the thinking open (default: this
        parser's `starts_in_reasoning`)."""
        return ReasoningStream(self, self.starts_in_reasoning if in_reasoning is None else in_reasoning)

    def extract_reasoning(self, text: str, in_reasoning: bool | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; None for an empty part."""
        s = self.streaming(in_reasoning)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return (r1 or "") + (r2 or "") or None, (c1 or "") + (c2 or "") or None


class ReasoningStream:
    """Splits one reply's text deltas into (reasoning delta, content delta). A marker cut across
    chunks is held back until it is known, so neither field ever sees a piece of it."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.p = parser
        # "open": at the reply's start, where an opening <think> may come (and is dropped);
        # "think": inside the thinking; "answer": after it.
        self.state = "open"
        self.in_reasoning = in_reasoning
        self.buf = ""

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        self.buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.state == "open":
                start = self.p.start_text
                if self.buf.startswith(start):
                    self.buf = self.buf[len(start):]
                    self.state = "think"
                    continue
                if start.startswith(self.buf):
                    break  # maybe the opening marker: wait for more
                self.state = "think" if self.in_reasoning else "answer"
                continue
            if self.state == "think":
                end = self.p.end_text
                i = self.buf.find(end)
                if i >= 0:
                    reasoning.append(self.buf[:i])
                    self.buf = self.buf[i + len(end):]
                    self.state = "answer"
                    continue
                k = held_suffix(self.buf, end)
                reasoning.append(self.buf[: len(self.buf) - k])
                self.buf = self.buf[len(self.buf) - k:]
                break
            content.append(self.buf)
            self.buf = ""
            break
        return "".join(reasoning) or None, "".join(content) or None

    def finish(self) -> tuple[str | None, str | None]:
        """The held-back text at the end of the reply."""
        rest, self.buf = self.buf, ""
        if not rest:
            return None, None
        if self.state == "think" or (self.state == "open" and self.in_reasoning):
            return rest, None
        return None, rest


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the reply starts inside the thinking (its generation prompt ends with <think>,
    or the model writes it first); everything up to </think> is reasoning, all of it when the reply
    never closes it."""

    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only when the reply opens with <think> or the prompt left it open (the
    template put it there); chat_template_kwargs {"enable_thinking": false} means no reasoning."""

    name = "qwen3"
    honours_enable_thinking = True
