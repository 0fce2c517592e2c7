"""Turns one step's logits into next tokens.

The model runner gathers the S rows that sample a token this step, builds a
`SamplingMetadata` once from their `SamplingRow`s, and calls
`Sampler()(logits, metadata)`. The sampler then, batched over rows:

1. blocks tokens outside `allowed_token_ids` and adds `logit_bias`;
2. blocks EOS and stop token ids while a row has fewer than `min_tokens` outputs;
3. applies repetition, presence and frequency penalties;
4. greedy rows take the argmax; random rows divide by their temperature, keep
   top-k, then top-p, then min-p, and draw by inverse CDF (one uniform number a
   row against the running sum of its probabilities), seeded rows from their own
   generator;
5. optionally returns logprobs of the sampled token and the top-k alternatives,
   computed from the raw logits (before any of the steps above).

Every optional part is None in the metadata when no row uses it, and the
sampler skips it; a batch of plain greedy rows is a single argmax.

`sample_isolating_faults` is what the runner calls: when sampling the batch
raises, it finds the rows that raise on their own, reports them as failed
(their requests end with an error) and samples the other rows as if the failed
ones had never been in the batch. An error no single row explains is re-raised
(an engine fault).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention.cpu_kernel import load_native
from pagedllm.sampling_params import SamplingParams, SamplingType
from pagedllm.worker.native_decode import argmax_rows

if TYPE_CHECKING:
    from pagedllm.worker.input_batch import InputBatch

_NEG_INF = float("-inf")
# Top-k (and top-p beside it) find each row's cut among its TOP_CANDIDATES largest logits (one
# torch.topk); a row whose cut lies beyond them takes the native kernel's top-p cut, or where that
# does not run a sort of its whole row. A full sort of the vocabulary costs about 2 ms a row here
# (49,152 tokens), a topk of 256 about 0.1 ms.
TOP_CANDIDATES = 256
# Random rows are sampled this many at a time (Sampler._sample_random).
SAMPLE_ROWS = 32

_SAMPLING_SRC = Path(__file__).parent / "csrc" / "sampling.c"


@lru_cache(maxsize=1)
def _sampling_kernel() -> ctypes.CDLL | None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return load_native(_SAMPLING_SRC, "PAGEDLLM_NATIVE_SAMPLING", {
        "top_p_cuts": ([p, i64, i64, i64, p, p], ctypes.c_int),
        "sample_rows": ([p, i64, i64, i64, p, p, p, p, p], ctypes.c_int),
    })


def top_p_cuts_apply(logits: torch.Tensor) -> bool:
    """Whether top_p_cuts runs on these logits: float32 CPU rows, and the kernel builds here."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] >= 1 and _sampling_kernel() is not None)


def sample_rows_native(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor | None:
    """One token per row of raw logits [S, V] (no top-k), in one native call (sampling.c
    `sample_rows`): divided by the row's temperature, cut at its top_p (top_p_cuts' cut) and then
    at min_p times its largest probability, drawn by inverse CDF in vocabulary order with its
    uniform number u [S, 1] (pick_from_probs' rule). None where it does not apply."""
    if not top_p_cuts_apply(logits):
        return None
    S = logits.shape[0]
    f32 = [t.to(torch.float32).contiguous() for t in (temperature, top_p, torch.zeros(S) if min_p is None else min_p)]
    uu = u.reshape(S).to(torch.float64).contiguous()
    tokens = torch.empty(S, dtype=torch.int64)
    if _sampling_kernel().sample_rows(logits.data_ptr(), logits.stride(0), S, logits.shape[1], f32[0].data_ptr(),
                                      f32[1].data_ptr(), f32[2].data_ptr(), uu.data_ptr(), tokens.data_ptr()):
        return None
    return tokens


def top_p_cuts(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Each row's top-p cut [S, 1] (the logit of the last token its nucleus keeps; -inf: the whole
    row) in O(V) a row by the native kernel (pagedllm/worker/csrc/sampling.c); None where it does
    not apply (top_p_cuts_apply; the caller sorts)."""
    if not top_p_cuts_apply(logits):
        return None
    lib = _sampling_kernel()
    p = top_p.to(torch.float32).contiguous()
    cut = torch.empty(logits.shape[0], 1, dtype=torch.float32)
    if lib.top_p_cuts(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], p.data_ptr(),
                      cut.data_ptr()):
        return None
    return cut

logger = logging.getLogger(__name__)

# Test hook, off unless set: "SEED" or "SEED:AFTER" makes building the sampling metadata raise
# SamplingFaultInjected for a row whose request has seed SEED once it has AFTER output tokens
# (default 0). It stands for a request whose sampling state breaks the sampler; the fault-isolation
# tests set it in the engine process's environment. Read once, at import.
SAMPLER_FAULT_ENV = "PAGEDLLM_TEST_SAMPLER_FAULT"


class SamplingFaultInjected(RuntimeError):
    """Raised by the PAGEDLLM_TEST_SAMPLER_FAULT test hook."""


def parse_sampler_fault(value: str | None) -> tuple[int, int] | None:
    """"7" -> (7, 0), "7:3" -> (7, 3), unset or "" -> None."""
    if not value:
        return None
    seed, _, after = value.partition(":")
    try:
        return int(seed), int(after or 0)
    except ValueError:
        raise ValueError(f"{SAMPLER_FAULT_ENV}={value!r}: expected SEED or SEED:AFTER (integers)") from None


_FAULT = parse_sampler_fault(os.environ.get(SAMPLER_FAULT_ENV))


def sampler_fault_hook() -> tuple[int, int] | None:
    """The PAGEDLLM_TEST_SAMPLER_FAULT test hook's (seed, after), or None when it is off (steps
    then need not build SamplingRows)."""
    return _FAULT


def _tensor(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; the copy to a GPU is queued, not waited for (the host
    list is staged before this returns), so building a step's metadata never waits for the
    forward pass still running on the GPU."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass
class SamplingRow:
    """One sampling row's inputs for this step, built by the model runner."""

    params: SamplingParams
    """The request's sampling parameters."""
    generator: torch.Generator | None
    """Set when `params.seed` is not None; the runner owns it and keeps it across steps."""
    prompt_token_ids: list[int]
    """The prompt (for the repetition penalty)."""
    output_token_ids: list[int]
    """Tokens generated so far (for penalties and min_tokens)."""
    eos_token_ids: set[int] = field(default_factory=set)
    """The model's EOS ids, blocked together with stop_token_ids while fewer than min_tokens are generated."""


@dataclass
class PenaltyMetadata:
    """Per-row penalties and the token ids they count, padded with the vocab size (an id no logit has)."""

    output_token_ids: torch.Tensor
    """[S, max_output_len] int64, padded with V."""
    prompt_token_ids: torch.Tensor | None
    """[S, max_prompt_len] int64, padded with V; None when no row has a repetition penalty."""
    repetition_penalties: torch.Tensor
    """[S] float32, 1.0 = off."""
    presence_penalties: torch.Tensor
    """[S] float32, 0.0 = off."""
    frequency_penalties: torch.Tensor
    """[S] float32, 0.0 = off."""


@dataclass
class SamplingMetadata:
    """Tensors for one step's sampling, built once from the rows; every optional part is None when unused."""

    vocab_size: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None
    """[S] float32; greedy rows hold 1.0 so the division is harmless. None when all rows are greedy."""
    greedy_mask: torch.Tensor | None
    """[S] bool, True for greedy rows; only set when greedy and random rows are mixed."""
    top_k: torch.Tensor | None
    """[S] int64 in [1, V]; V for rows without top-k. None when no row uses top-k."""
    top_p: torch.Tensor | None
    """[S] float32; 1.0 for rows without top-p. None when no row uses top-p."""
    min_p: torch.Tensor | None
    """[S] float32; 0.0 for rows without min-p. None when no row uses min-p."""
    generators: dict[int, torch.Generator]
    """Row index -> generator, for seeded random rows."""
    max_num_logprobs: int | None
    """Largest `params.logprobs` over the rows; None when no row asks for logprobs."""
    allowed_mask: torch.Tensor | None = None
    """[S, V] bool, True where a token is not allowed; None when no row restricts its tokens."""
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids) that get a logit bias."""
    bias_values: torch.Tensor | None = None
    """float32 bias added at `bias_index`."""
    min_tokens_index: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids) blocked this step because the row has not reached min_tokens."""
    penalties: PenaltyMetadata | None = None

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processing (mask, bias, min_tokens, penalties) applies this step."""
        return not (
            self.allowed_mask is None
            and self.bias_index is None
            and self.min_tokens_index is None
            and self.penalties is None
        )

    @property
    def argmax_only(self) -> bool:
        """Whether the step's sampling is the argmax of the raw logits and nothing else: every row
        greedy, no logits processing, no logprobs."""
        return self.all_greedy and self.max_num_logprobs is None and not self.needs_processing

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> SamplingMetadata:
        """Builds the step's sampling tensors from the rows, in row order."""
        if _FAULT is not None:
            _inject_fault(rows, _FAULT)
        greedy = [r.params.sampling_type == SamplingType.GREEDY for r in rows]
        all_greedy, all_random = all(greedy), not any(greedy)
        num_logprobs = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        ruled = [(i, r.params) for i, r in enumerate(rows) if r.params.logit_bias or r.params.allowed_token_ids is not None]
        bias_index, bias_values = _logit_bias(ruled, device)
        blocked = [(i, r.eos_token_ids | r.params.all_stop_token_ids) for i, r in enumerate(rows)
                   if len(r.output_token_ids) < r.params.min_tokens]
        return cls(
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=None if all_greedy else _temperatures(rows, greedy, device),
            greedy_mask=None if all_greedy or all_random else _tensor(greedy, torch.bool, device),
            top_k=_top_k(rows, vocab_size, device),
            top_p=_optional_f32([r.params.top_p for r in rows], 1.0, device),
            min_p=_optional_f32([r.params.min_p for r in rows], 0.0, device),
            generators=_generators(rows),
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            allowed_mask=_allowed_mask(ruled, len(rows), vocab_size, device),
            bias_index=bias_index,
            bias_values=bias_values,
            min_tokens_index=_min_tokens_index(blocked, device),
            penalties=_penalties(rows, vocab_size, device),
        )

    @classmethod
    def from_batch(cls, batch: InputBatch, rows: np.ndarray, vocab_size: int, device: torch.device) -> SamplingMetadata:
        """The same tensors as `from_rows`, for rows `rows` of the runner's persistent batch (in
        sampling order), built from its arrays: no per-row Python except for the rows that use
        logit_bias, allowed_token_ids or min_tokens, or are seeded."""
        static = cls.static_from_batch(batch, rows, vocab_size, device)
        return static.with_token_state(batch, rows, device)

    @classmethod
    def static_from_batch(
        cls, batch: InputBatch, rows: np.ndarray, vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        """The parts that depend only on the rows' sampling parameters (not on their tokens so far):
        valid as long as the same rows hold the same requests (`batch.version` unchanged)."""
        greedy = batch.greedy[rows]
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        temperature = None
        if not all_greedy:
            temperature = torch.from_numpy(np.where(greedy, np.float32(1.0), batch.temperature[rows])).to(device)
        ks = batch.top_k[rows]
        ks = np.where(ks <= 0, vocab_size, np.minimum(ks, vocab_size))
        top_p, min_p = batch.top_p[rows], batch.min_p[rows]
        lp = batch.logprobs[rows]
        ruled = [(int(j), batch.params[rows[j]]) for j in np.nonzero(batch.has_token_rules[rows])[0]]
        bias_index, bias_values = _logit_bias(ruled, device)
        return cls(
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=temperature,
            greedy_mask=None if all_greedy or all_random else torch.from_numpy(greedy.copy()).to(device),
            top_k=None if (ks == vocab_size).all() else torch.from_numpy(ks).to(device),
            top_p=None if (top_p == 1.0).all() else torch.from_numpy(top_p).to(device),
            min_p=None if (min_p == 0.0).all() else torch.from_numpy(min_p).to(device),
            generators={int(j): batch.generators[rows[j]] for j in np.nonzero(batch.seeded[rows])[0]},
            max_num_logprobs=int(lp.max()) if (lp >= 0).any() else None,
            allowed_mask=_allowed_mask(ruled, len(rows), vocab_size, device),
            bias_index=bias_index,
            bias_values=bias_values,
        )

    def with_token_state(self, batch: InputBatch, rows: np.ndarray, device: torch.device) -> SamplingMetadata:
        """This metadata with the parts that depend on the rows' tokens so far (min_tokens and the
        penalties) computed for this step; itself when no row uses them."""
        num_out = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
        short = np.nonzero(num_out < batch.min_tokens[rows])[0]
        rep = batch.repetition_penalty[rows]
        presence, frequency = batch.presence_penalty[rows], batch.frequency_penalty[rows]
        uses_repetition = bool((rep != 1.0).any())
        has_penalties = uses_repetition or bool(presence.any()) or bool(frequency.any())
        if len(short) == 0 and not has_penalties:
            return self
        blocked = [(int(j), batch.eos_token_ids[rows[j]] | batch.params[rows[j]].all_stop_token_ids) for j in short]
        penalties = None
        if has_penalties:
            V = self.vocab_size
            starts = batch.num_prompt_tokens[rows]
            prompts = _gather_padded(batch.token_ids, rows, np.zeros_like(starts), starts, V, device)
            penalties = PenaltyMetadata(
                output_token_ids=_gather_padded(batch.token_ids, rows, starts, batch.num_tokens[rows], V, device),
                prompt_token_ids=prompts if uses_repetition else None,
                repetition_penalties=torch.from_numpy(rep).to(device),
                presence_penalties=torch.from_numpy(presence).to(device),
                frequency_penalties=torch.from_numpy(frequency).to(device),
            )
        return replace(self, min_tokens_index=_min_tokens_index(blocked, device), penalties=penalties)


def _gather_padded(
    token_ids: np.ndarray, rows: np.ndarray, begin: np.ndarray, end: np.ndarray, pad_id: int, device: torch.device
) -> torch.Tensor:
    """token_ids[rows[j], begin[j]:end[j]] right-padded with pad_id into one int64 tensor."""
    width = int((end - begin).max()) if len(rows) else 0
    cols = begin[:, None] + np.arange(width)[None, :]
    valid = cols < end[:, None]
    gathered = token_ids[rows[:, None], np.where(valid, cols, 0)]
    return torch.from_numpy(np.where(valid, gathered, pad_id)).to(device)


def _inject_fault(rows: list[SamplingRow], fault: tuple[int, int]) -> None:
    seed, after = fault
    for r in rows:
        if r.params.seed == seed and len(r.output_token_ids) >= after:
            raise SamplingFaultInjected(f"injected sampler fault (seed {seed}, {len(r.output_token_ids)} tokens)")


def _temperatures(rows: list[SamplingRow], greedy: list[bool], device: torch.device) -> torch.Tensor:
    """Per-row temperature, 1.0 for greedy rows (their random sample is discarded)."""
    temps = [1.0 if g else r.params.temperature for r, g in zip(rows, greedy)]
    return _tensor(temps, torch.float32, device)


def _optional_f32(values: list[float], off: float, device: torch.device) -> torch.Tensor | None:
    """The values as a float32 tensor, or None when every value is the `off` value."""
    if all(v == off for v in values):
        return None
    return _tensor(values, torch.float32, device)


def _top_k(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """Per-row k clamped to [1, V] (0 = off becomes V), or None when no row keeps fewer than V tokens."""
    ks = [vocab_size if r.params.top_k <= 0 else min(r.params.top_k, vocab_size) for r in rows]
    if all(k == vocab_size for k in ks):
        return None
    return _tensor(ks, torch.int64, device)


def _generators(rows: list[SamplingRow]) -> dict[int, torch.Generator]:
    """Row index -> generator for the seeded random rows (greedy rows draw nothing)."""
    generators: dict[int, torch.Generator] = {}
    for i, row in enumerate(rows):
        if row.params.sampling_type == SamplingType.RANDOM_SEED:
            assert row.generator is not None, "the runner must give every seeded row its generator"
            generators[i] = row.generator
    return generators


def _allowed_mask(
    ruled: list[tuple[int, SamplingParams]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[S, V] bool, True where a row's allowed_token_ids excludes the token; None when no row restricts.
    `ruled`: (row, params) of the rows that may restrict (others are left alone)."""
    restricted = [(i, p) for i, p in ruled if p.allowed_token_ids is not None]
    if not restricted:
        return None
    mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    mask[[i for i, _ in restricted]] = True
    row_ids = [i for i, p in restricted for _ in p.allowed_token_ids or []]
    token_ids = [t for _, p in restricted for t in p.allowed_token_ids or []]
    mask[_tensor(row_ids, torch.int64, device), _tensor(token_ids, torch.int64, device)] = False
    return mask


def _logit_bias(
    ruled: list[tuple[int, SamplingParams]], device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    """(rows, token ids) and values of the logit_bias entries of the (row, params) given, or (None, None)."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, params in ruled:
        for token, bias in (params.logit_bias or {}).items():
            row_ids.append(i)
            token_ids.append(int(token))
            values.append(float(bias))
    if not row_ids:
        return None, None
    index = (_tensor(row_ids, torch.int64, device), _tensor(token_ids, torch.int64, device))
    return index, _tensor(values, torch.float32, device)


def _min_tokens_index(
    blocked: list[tuple[int, set[int] | frozenset[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) to block, from (row, its EOS and stop ids) of the rows that have generated
    fewer than min_tokens; None when there are none."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, ids in blocked:
        ordered = sorted(ids)
        row_ids.extend([i] * len(ordered))
        token_ids.extend(ordered)
    if not row_ids:
        return None
    return _tensor(row_ids, torch.int64, device), _tensor(token_ids, torch.int64, device)


def _penalties(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> PenaltyMetadata | None:
    """Penalty tensors, or None when every row has the default (no-op) penalties."""
    rep = [r.params.repetition_penalty for r in rows]
    presence = [r.params.presence_penalty for r in rows]
    frequency = [r.params.frequency_penalty for r in rows]
    uses_repetition = any(p != 1.0 for p in rep)
    if not (uses_repetition or any(presence) or any(frequency)):
        return None
    prompts = _pad([r.prompt_token_ids for r in rows], vocab_size, device) if uses_repetition else None
    return PenaltyMetadata(
        output_token_ids=_pad([r.output_token_ids for r in rows], vocab_size, device),
        prompt_token_ids=prompts,
        repetition_penalties=_tensor(rep, torch.float32, device),
        presence_penalties=_tensor(presence, torch.float32, device),
        frequency_penalties=_tensor(frequency, torch.float32, device),
    )


def _pad(token_lists: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Right-pads the lists into one int64 tensor: [[3, 4], [5]], pad 9 -> [[3, 4], [5, 9]]."""
    width = max((len(t) for t in token_lists), default=0)
    padded = [list(t) + [pad_id] * (width - len(t)) for t in token_lists]
    return _tensor(padded, torch.int64, device).reshape(len(token_lists), width)


@dataclass
class SamplerOutput:
    """The step's sampled tokens and, when some row asked, their logprobs."""

    sampled_token_ids: torch.Tensor
    """[S] int64."""
    logprob_token_ids: torch.Tensor | None
    """[S, 1 + max_k] int64: the sampled token first, then the top max_k tokens by logprob."""
    logprobs: torch.Tensor | None
    """[S, 1 + max_k] float32 logprobs of those ids."""
    sampled_token_ranks: torch.Tensor | None
    """[S] int64 rank of the sampled token (1 = most likely)."""


class Sampler(torch.nn.Module):
    """Batched sampling for one step: logits processing, greedy / random draws and logprobs."""

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Samples one token per row of `logits` ([S, V] float32, left unmodified)."""
        assert logits.dim() == 2 and logits.shape[1] == md.vocab_size, (tuple(logits.shape), md.vocab_size)
        processed = self.process_logits(logits, md)
        if md.all_greedy:
            sampled = row_argmax(processed)
        else:
            sampled = self._sample_random(processed, md)
            if md.greedy_mask is not None:
                sampled = torch.where(md.greedy_mask, row_argmax(processed), sampled)
        if md.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, logprobs, ranks = compute_topk_logprobs(logits, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, ids, logprobs, ranks)

    def process_logits(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Allowed-token mask and logit bias, then min_tokens, then penalties; returns a new tensor if any apply."""
        logits = logits.float()
        if not md.needs_processing:
            return logits
        logits = logits.clone()
        if md.allowed_mask is not None:
            logits.masked_fill_(md.allowed_mask, _NEG_INF)
        if md.bias_index is not None:
            assert md.bias_values is not None
            logits.index_put_(md.bias_index, md.bias_values, accumulate=True)
        if md.min_tokens_index is not None:
            logits.index_put_(md.min_tokens_index, logits.new_full((), _NEG_INF))
        if md.penalties is not None:
            logits = apply_penalties(logits, md.penalties)
        return logits

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one inverse-CDF draw per row, SAMPLE_ROWS rows at
        a time (each pass over a chunk's [rows, V] temporaries stays in the cache, and none of them
        outgrows the heap that keeps them mapped between steps: 256 rows of 49,152 float32 logits
        are 50 MB, faulted in afresh by every op that makes one)."""
        assert md.temperature is not None
        u = draw_uniforms(logits.shape[0], md.generators, logits.device)
        if logits.shape[0] <= SAMPLE_ROWS:
            return _sample_rows(logits, md.temperature, md.top_k, md.top_p, md.min_p, u)
        out = []
        for a in range(0, logits.shape[0], SAMPLE_ROWS):
            rows = slice(a, a + SAMPLE_ROWS)
            out.append(_sample_rows(logits[rows], md.temperature[rows], _rows(md.top_k, rows), _rows(md.top_p, rows),
                                    _rows(md.min_p, rows), u[rows]))
        return torch.cat(out)


def _rows(t: torch.Tensor | None, rows: slice | torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[rows]


def _sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Random rows' tokens (see Sampler._sample_random), each drawn with its uniform number u [S, 1].

    Each row takes one of three ways, chosen from its own settings and logits alone, so that a
    seeded row draws the same tokens in any batch:
    - no top-k and no top-p: its whole row;
    - top-p without top-k, where the native kernel runs: the whole draw in one native call
      (`sample_rows_native`: its row cut at top_p in one pass whatever the size of the nucleus, a
      model unsure of its next token spreading 0.95 of its mass over thousands of tokens);
    - otherwise its largest logits (`top_candidates`) when its cut lies among them, else its whole
      row cut by `apply_top_k_top_p`.
    """
    S, V = logits.shape
    none = torch.zeros(S, dtype=torch.bool, device=logits.device)
    k_on = none if top_k is None else top_k < V
    p_on = none if top_p is None else top_p < 1.0
    native = bool(p_on.any()) and top_p_cuts_apply(logits)
    ways = (~k_on & ~p_on, ~k_on & p_on if native else none)
    ways = (*ways, ~(ways[0] | ways[1]))
    tokens = torch.empty(S, dtype=torch.int64, device=logits.device)
    for way, rows_mask in enumerate(ways):
        if not bool(rows_mask.any()):
            continue
        every = bool(rows_mask.all())
        rows = slice(None) if every else rows_mask.nonzero().squeeze(1)
        x, t, mp, ur = (logits, temperature, min_p, u) if every else (
            logits[rows], temperature[rows], _rows(min_p, rows), u[rows])
        if way == 1 and (drawn := sample_rows_native(x, t, top_p[rows], mp, ur)) is not None:
            tokens[rows] = drawn
            continue
        x = x / t.unsqueeze(1)
        if way == 0:
            tokens[rows] = pick_from_probs(_truncated_probs(x, mp), ur)
        else:  # way 2, or way 1 where the native call could not run
            tokens[rows] = _sample_candidates(x, _rows(top_k, rows), _rows(top_p, rows), mp, ur)
    return tokens


def _sample_candidates(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                       min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Rows drawn from their largest logits where their cut lies among them, else from their whole
    row cut by apply_top_k_top_p."""
    vals, ids, inside = top_candidates(logits, top_k, top_p)
    if bool(inside.all()):
        return ids.gather(1, pick_from_probs(_truncated_probs(vals, min_p), u).unsqueeze(1)).squeeze(1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for rows, in_candidates in ((inside.nonzero().squeeze(1), True), ((~inside).nonzero().squeeze(1), False)):
        if rows.numel() == 0:
            continue
        if in_candidates:
            picked = pick_from_probs(_truncated_probs(vals[rows], _rows(min_p, rows)), u[rows])
            tokens[rows] = ids[rows].gather(1, picked.unsqueeze(1)).squeeze(1)
        else:
            cut = apply_top_k_top_p(logits[rows], _rows(top_k, rows), _rows(top_p, rows))
            tokens[rows] = pick_from_probs(_truncated_probs(cut, _rows(min_p, rows)), u[rows])
    return tokens


def _truncated_probs(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """softmax of each row (-inf logits: probability 0), then min-p."""
    probs = logits.softmax(dim=-1)
    return probs if min_p is None else apply_min_p(probs, min_p)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of [S, V] (torch.argmax's answer): on the CPU one native pass per row,
    where torch's reduction runs scalar (pagedllm/worker/native_decode.py `argmax_rows`)."""
    ids = argmax_rows(x)
    return x.argmax(dim=-1) if ids is None else ids


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] float32 count of each token per row, ignoring the pad id V.

    token_ids [[2, 2, 0], [1, 3, 3]] with V = 3 (3 is padding) -> [[1, 0, 2], [0, 1, 0]]:
    the pad lands in an extra column V that is cut off.
    """
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, p: PenaltyMetadata) -> torch.Tensor:
    """Repetition (prompt or output tokens), then frequency and presence (output tokens) penalties."""
    vocab_size = logits.shape[1]
    output_counts = _token_counts(p.output_token_ids, vocab_size)
    output_seen = output_counts > 0
    if p.prompt_token_ids is not None:
        seen = output_seen | (_token_counts(p.prompt_token_ids, vocab_size) > 0)
        rep = p.repetition_penalties.unsqueeze(1)
        # Shrinks seen tokens' logits toward 0 from either side: 2.0 -> 2.0 / rep, -2.0 -> -2.0 * rep.
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - p.frequency_penalties.unsqueeze(1) * output_counts
    return logits - p.presence_penalties.unsqueeze(1) * output_seen


def top_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's largest logits and its top-k / top-p cut among them.

    A row's candidates are its k + 1 largest logits with a top-k, at least TOP_CANDIDATES of them
    with a top-p: a number set by the row alone, so that whether its cut lies among them does not
    depend on the other rows of the batch. Returns (vals, ids, inside): the batch's largest logits
    in descending order [S, C] (C the most any row needs), -inf below each row's cut, their token
    ids [S, C], and whether the row keeps nothing outside its own candidates [S] (its cut is above
    the last of them, or they are the whole vocabulary). A row that is not inside keeps tokens
    beyond them (no cut, a nucleus wider than they are, or ties with the cut outside them):
    `apply_top_k_top_p` on its whole row. The cut is apply_top_k_top_p's: top-k keeps the k largest
    logits and ties with the k-th; top-p the smallest run of largest logits whose probability after
    top-k reaches top_p, and ties with the last of them.
    """
    S, V = logits.shape
    none = torch.zeros(S, dtype=torch.bool, device=logits.device)
    k_on = none if top_k is None else top_k < V  # rows with a top-k (k = V: off)
    p_on = none if top_p is None else top_p < 1.0
    # One candidate past k: a top-k cut above it keeps nothing outside the candidates.
    own = (torch.where(k_on, top_k + 1, 1) if top_k is not None
           else torch.ones(S, dtype=torch.int64, device=logits.device))
    own = torch.where(p_on, own.clamp(min=TOP_CANDIDATES), own).clamp(max=V)
    kc = int(own.max())
    vals, ids = logits.topk(kc, dim=-1)  # descending
    cut = torch.full((S, 1), _NEG_INF, device=logits.device)
    if top_k is not None:
        cut = _kth(vals, top_k, k_on)
        vals = vals.masked_fill(vals < cut, _NEG_INF)
    if top_p is not None:
        # Probabilities of the candidates under the row's softmax after top-k (over the candidates for
        # top-k rows, whose kept tokens they hold when the row is inside), their running sum in
        # descending order, and the first position where it reaches top_p: the last token kept.
        lse = vals.logsumexp(dim=-1, keepdim=True)
        if not bool(k_on.all()):
            lse = torch.where(k_on.unsqueeze(1), lse, logits.logsumexp(dim=-1, keepdim=True))
        last = ((vals - lse).exp().cumsum(dim=-1) < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)
        p_cut = vals.gather(1, last.clamp(max=kc - 1)).masked_fill(~p_on.unsqueeze(1), _NEG_INF)
        # A nucleus past the row's own candidates: no cut among them (the row is not inside).
        p_cut = p_cut.masked_fill((last >= own.unsqueeze(1)) & p_on.unsqueeze(1), float("nan"))
        cut = torch.maximum(cut, p_cut)  # NaN stays NaN
        vals = vals.masked_fill(vals < cut, _NEG_INF)
    # The row's last candidate, masked above when below the cut (equal to it: ties may lie outside).
    last_own = vals.gather(1, (own - 1).unsqueeze(1)).squeeze(1)
    inside = (cut.squeeze(1) > last_own) | (own >= V)
    return vals, ids, inside


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    top-k keeps the k largest logits and every logit equal to the k-th (never fewer than k). top-p
    keeps the smallest run of largest logits whose probability (after top-k) reaches top_p, and
    every logit equal to the last of them; a row always keeps its largest logit, and rows with top_p
    1.0 keep everything. top-k: the k-th of torch.topk. top-p: the native kernel's cut
    (`top_p_cuts`, one pass a row), or where it does not run a sort of each whole row
    (`_top_k_top_p_sorted`). The sampler calls it for the rows whose cut its candidates do not hold.
    """
    V = logits.shape[1]
    if top_k is not None and bool((k_on := top_k < V).any()):
        vals = logits.topk(int(top_k[k_on].max()), dim=-1).values
        logits = logits.masked_fill(logits < _kth(vals, top_k, k_on), _NEG_INF)
    if top_p is None:
        return logits
    cut = top_p_cuts(logits, top_p)
    return _top_k_top_p_sorted(logits, None, top_p) if cut is None else logits.masked_fill(logits < cut, _NEG_INF)


def _kth(vals: torch.Tensor, top_k: torch.Tensor, k_on: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest logit [S, 1] from its largest ones in descending order, vals [S, C]
    (C at least every k of the rows in k_on), -inf where top-k is off. Column k - 1 holds it:
    top_k [2, 5] -> columns [1, 4]."""
    return vals.gather(1, (top_k.clamp(max=vals.shape[1]) - 1).unsqueeze(1)).masked_fill(~k_on.unsqueeze(1), _NEG_INF)


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """apply_top_k_top_p by sorting every row whole (where the native cut does not run)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each sorted position: probs [0.5, 0.3, 0.2] -> [0.0, 0.5, 0.8]. With top_p 0.8
        # the third token goes (0.8 already reached), the first two stay; column 0 (mass 0.0) always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p 1.0 keep everything, even if rounding pushes the running sum to 1.0 early.
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        # Ties with the last token kept stay, as in the candidates' path.
        cut = sorted_logits.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cut, _NEG_INF)
    # Undo the sort: sorted position j of row r came from column order[r, j].
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes probabilities below min_p times the row's largest one (rows need not be renormalized)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def draw_uniforms(rows: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) per row [rows, 1] (float64): unseeded rows in one batched call
    from the default generator, then each seeded row its own from its generator, so that its samples
    depend neither on the other rows nor on its position in the batch."""
    u = torch.empty(rows, 1, dtype=torch.float64, device=device)
    if len(generators) < rows:
        u.uniform_()
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    return u


def pick_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column of each row of `probs` ([S, C], rows need not sum to 1) drawn by inverse CDF with the
    row's uniform u [S, 1]: the first column whose running sum exceeds u times the row's total, so
    a column of probability 0 is never drawn. One running sum a row, not a random number per token:
    the exponential race (argmax(probs / q), q ~ Exp(1)) draws S * C numbers, 130 ms for 128 rows of
    49,152 here.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Below the total by at least one step of float32 (u * total may round up to it): the first
    # running sum above the target then always belongs to a column of non-zero probability.
    target = torch.minimum((u * total.double()).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    # A row with nothing to draw (all zero or NaN) gets its last column rather than one past the end.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def compute_topk_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of `token_ids` and of each row's top-k tokens, from log_softmax(logits).

    Returns ids [N, 1 + k] int64 (the given token first, then the top k by logprob, descending), their float32
    logprobs [N, 1 + k], and ranks [N] int64 of the given token (1 + number of tokens with a strictly larger
    logprob). k is capped at the vocabulary size.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    ids = torch.cat([token_ids, top_ids], dim=1)
    return ids, torch.cat([token_logprobs, top_logprobs], dim=1), ranks


@dataclass
class IsolatedSample:
    """One step's sampling with failing rows left out."""

    output: SamplerOutput | None
    """The sampled rows' tokens (and logprobs), in `kept` order; None when every row failed."""
    kept: list[int]
    """Indices (into the step's rows) of the rows sampled."""
    failed: dict[int, str]
    """Row index -> the error that row raised on its own."""


def sample_isolating_faults(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow] | Callable[[], list[SamplingRow]],
    device: torch.device,
    metadata: Callable[[], SamplingMetadata] | None = None,
    generators: list[torch.Generator] | None = None,
) -> IsolatedSample:
    """Samples every row at once; if that raises, isolates the rows that raise on their own.

    `metadata` builds the batch's sampling tensors (default: from the rows); `rows` are the per-row
    views, or a function that builds them (called only when needed); `generators` are the rows' random generators
    (default: those of the rows). Failing rows are reported as failed and the others are sampled
    again, together, from the same logits, with their random generators first put back where they
    were: greedy and seeded rows get exactly the tokens they would have got had the failed rows
    never been in the batch. If no single row raises, the batch's error is re-raised: it is not any
    one request's fault.
    """
    vocab_size = logits.shape[-1]
    given = rows

    def row_views() -> list[SamplingRow]:
        return given() if callable(given) else given

    if generators is None:
        generators = [r.generator for r in row_views() if r.generator is not None]
    saved = [(g, g.get_state()) for g in generators]
    if metadata is None or _FAULT is not None:  # the test hook sits in from_rows
        metadata = lambda: SamplingMetadata.from_rows(row_views(), vocab_size, device)  # noqa: E731
    try:
        out = sampler(logits, metadata())
        return IsolatedSample(out, list(range(logits.shape[0])), {})
    except Exception as batch_error:
        error = batch_error

    def rewind() -> None:
        for g, state in saved:
            g.set_state(state)

    views = row_views()
    failed: dict[int, str] = {}
    for i, row in enumerate(views):
        rewind()
        try:
            sampler(logits[i : i + 1], SamplingMetadata.from_rows([row], vocab_size, device))
        except Exception as e:
            failed[i] = f"{type(e).__name__}: {e}"
    if not failed:
        raise error
    logger.error("sampling failed for %d of %d rows: %s", len(failed), len(views), "; ".join(failed.values()))
    rewind()
    kept = [i for i in range(len(views)) if i not in failed]
    if not kept:
        return IsolatedSample(None, [], failed)
    index = torch.tensor(kept, dtype=torch.long, device=logits.device)
    out = sampler(logits.index_select(0, index), SamplingMetadata.from_rows([views[i] for i in kept], vocab_size, device))
    return IsolatedSample(out, kept, failed)
