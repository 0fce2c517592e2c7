"""Incremental detokenization with stop strings matched across token boundaries."""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagedllm.sampling_params import SamplingParams

# Prompt tokens given to the decoder as context, so the first output piece is spaced correctly.
_CONTEXT_TOKENS = 6

fault_hook: Callable[[list[int]], None] | None = None
"""A hook point for tests, None otherwise: when set, `IncrementalDetokenizer.update` calls it with
the token ids it is about to decode. The fault-isolation tests set it to a function that raises
for one token id (a detokenizer that fails on one request's output) and check that the request
fails alone."""


class IncrementalDetokenizer:
    """Turns a sequence's new token ids into text, one step at a time (Rust DecodeStream)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stream = DecodeStream(
            ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=params.skip_special_tokens
        )
        self.text = ""
        self.stop: list[str] = list(params.stop or [])  # type: ignore[arg-type]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.num_sent = 0  # characters already handed out as deltas
        # Index, in the last update's tokens, of the token whose text completed a stop string
        # (a step may bring several tokens: speculative decoding's accepted ones).
        self.stop_index = -1

    def update(self, new_token_ids: list[int], skip_last: bool = False) -> str | None:
        """Appends the text of new tokens; returns the stop string that matched, if any.

        `skip_last` leaves out the final token (an EOS or stop token that ended the sequence).
        """
        ids = new_token_ids[:-1] if skip_last else new_token_ids
        if fault_hook is not None:
            fault_hook(ids)
        for i, tid in enumerate(ids):
            piece = self.stream.step(self.tokenizer, tid)
            if not piece:
                continue
            self.text += piece
            if self.stop:
                matched = self._check_stop(len(piece))
                if matched is not None:
                    self.stop_index = i
                    return matched
        return None

    def _check_stop(self, new_chars: int) -> str | None:
        # Only a match that ends inside the new piece is new: search from max_stop_len - 1 before it.
        start = max(0, len(self.text) - new_chars - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        end = i + len(s) if self.params.include_stop_str_in_output else i
        self.text = self.text[:end]
        return s

    def get_delta(self, finished: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix until it resolves."""
        limit = len(self.text)
        if not finished and self.stop and not self.params.include_stop_str_in_output:
            limit = max(self.num_sent, limit - self.max_stop_len + 1)
        delta = self.text[self.num_sent : limit]
        self.num_sent = limit
        return delta
