"""The sampling metadata: one step's sampling parameters as batched tensors.

The model runner builds a `SamplingMetadata` once a step, from the persistent batch's arrays
(`from_batch`: the parameter part is reused while the same rows hold the same requests) or from
per-row `SamplingRow`s (`from_rows`, which fault isolation uses to sample rows on their own).
Every optional part is None when no row uses it, and the sampler then skips it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams, SamplingType
from pagedllm.worker.sample.row import SamplingRow

if TYPE_CHECKING:
    from pagedllm.worker.input_batch import InputBatch

fault_hook: Callable[[list[SamplingRow]], None] | None = None
"""A hook point for tests, None otherwise: when set, `SamplingMetadata.from_rows` calls it with the
rows first, and every step builds its metadata from rows (`sample_isolating_faults`; the runner's
native LM head leaves the choice of tokens to the sampler), so that it sees each row. The
fault-isolation tests set it to a function that raises for the row of one request (standing for
a request whose sampling state breaks the sampler) and check that the request fails alone."""


def sampler_fault_hook() -> Callable[[list[SamplingRow]], None] | None:
    """The `fault_hook` set, or None when there is none (steps then need not build SamplingRows)."""
    return fault_hook


def _tensor(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; the copy to a GPU is queued, not waited for (the host
    list is staged before this returns), so building a step's metadata never waits for the
    forward pass still running on the GPU."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


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
        if fault_hook is not None:
            fault_hook(rows)
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
