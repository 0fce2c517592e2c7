"""The worker's requests and per-step model inputs in numpy: token ids, positions, slot mapping,
attention groups.

`InputBatch` keeps the requests in preallocated arrays, changed in place as they change; each
step's `BatchArrays` are computed from them once, on the CPU, without torch, so it can be tested
on its own and so no layer ever loops over requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.sampling_params import SamplingType


@dataclass
class RequestState:
    """What the worker keeps about a request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + generated tokens (the worker appends what it samples)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: object
    eos_token_ids: set[int] | frozenset[int] = field(default_factory=frozenset)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class GroupArrays:
    batch_size: int
    max_query_len: int
    query_index: np.ndarray  # [B * max_q]
    out_rows: np.ndarray  # [N]
    out_dest: np.ndarray  # [N]
    block_tables: np.ndarray  # [B, max_blocks]
    mask: np.ndarray  # [B, 1, max_q, max_blocks * block_size] bool
    reqs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [B] request indices


@dataclass
class DenseChunk:
    """One long prompt chunk attended densely: its context is gathered once per layer."""

    query_start: int  # first row of the chunk in the flat batch
    query_len: int
    blocks: np.ndarray  # [ceil(seq_len / block_size)] block ids of the context, in order
    seq_len: int  # keys 0 .. seq_len - 1 (the cached context plus the chunk itself)
    req: int = 0  # its request's index in the batch


@dataclass
class KVGroupArrays:
    """Where a layer group other than the first reads and writes its K/V this step (with KV layer
    groups, core/kv_groups.py): the fields of BatchArrays that come from the block table."""

    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [R, max_blocks]
    group_block_tables: list[np.ndarray]  # per attention group, as GroupArrays.block_tables
    dense_blocks: list[np.ndarray]  # per dense chunk, as DenseChunk.blocks


@dataclass
class BatchArrays:
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R + 1]
    seq_lens: np.ndarray  # [R]
    block_tables: np.ndarray  # [R, max_blocks]
    work: np.ndarray  # [W, 3] native-kernel work items: (request, first query token, tokens)
    # Requests whose chunk is long enough for dense attention (fused SDPA over their gathered
    # context) instead of the paged kernel; they have no work items.
    dense: list[DenseChunk]
    groups: list[GroupArrays]
    # Rows of the flat batch whose logits are sampled, and which requests they belong to.
    sample_rows: np.ndarray
    sample_req_indices: np.ndarray
    # Layer groups 1 .. G - 1 (the fields above are group 0's); empty with one group.
    kv_groups: list[KVGroupArrays] = field(default_factory=list)


def build_batch(
    states: list[RequestState],
    num_scheduled: list[int],
    block_size: int,
    sliding_window: int | None = None,
    build_groups: bool = True,
    query_tile: int = 8,
    dense_min_tokens: int = 0,
    dense_min_pairs: int = 0,
    num_kv_groups: int = 1,
) -> BatchArrays:
    """The step's arrays from per-request objects (the runner keeps an `InputBatch` instead; this is
    its reference and serves tests and tools that lay out a batch by hand). With `num_kv_groups`
    G > 1 the block ids are G per block of tokens, interleaved (core/kv_cache_manager.py).

    `dense_min_tokens` > 0: chunks of at least that many tokens, with at least `dense_min_pairs`
    query-key pairs (causal), are attended densely."""
    R = len(states)
    n = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.asarray([s.num_computed_tokens for s in states], dtype=np.int64)
    max_blocks = max((len(s.block_ids) for s in states), default=1)
    table = np.zeros((R, max(max_blocks, 1)), dtype=np.int64)
    for i, s in enumerate(states):
        table[i, : len(s.block_ids)] = s.block_ids
    qsl = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(n, out=qsl[1:])
    input_ids = np.empty(int(qsl[-1]), dtype=np.int64)
    for i, s in enumerate(states):
        input_ids[qsl[i] : qsl[i + 1]] = s.token_ids[starts[i] : starts[i] + n[i]]
    total = np.asarray([len(s.token_ids) for s in states], dtype=np.int64)
    return _layout(n, starts, total, _group_tables(table, num_kv_groups), lambda req, pos: input_ids, block_size,
                   sliding_window, build_groups, query_tile, dense_min_tokens, dense_min_pairs)


def _group_tables(table: np.ndarray, num_kv_groups: int) -> list[np.ndarray]:
    """Each layer group's block table from the interleaved one (entry i * G + g: group g)."""
    if num_kv_groups == 1:
        return [table]
    return [np.ascontiguousarray(table[:, g::num_kv_groups]) for g in range(num_kv_groups)]


def _kv_groups(tables: list[np.ndarray], req: np.ndarray, positions: np.ndarray, block_size: int,
               groups: list[GroupArrays], dense: list[DenseChunk]) -> list[KVGroupArrays]:
    """The block-table fields of groups 1 .. G - 1, laid out as group 0's."""
    blk, off = positions // block_size, positions % block_size
    return [
        KVGroupArrays(
            slot_mapping=t[req, blk] * block_size + off,
            block_tables=t,
            group_block_tables=[t[g.reqs, : g.block_tables.shape[1]] for g in groups],
            dense_blocks=[t[d.req, : len(d.blocks)].copy() for d in dense],
        )
        for t in tables[1:]
    ]


def _layout(
    n: np.ndarray,
    starts: np.ndarray,
    total: np.ndarray,
    tables: list[np.ndarray],
    token_ids: Callable[[np.ndarray, np.ndarray], np.ndarray],
    block_size: int,
    sliding_window: int | None,
    build_groups: bool,
    query_tile: int,
    dense_min_tokens: int,
    dense_min_pairs: int,
) -> BatchArrays:
    """The batch of R requests that compute n[i] tokens from position starts[i] on, out of
    total[i] known tokens, with block table rows `tables[g]` [R, max_blocks] per layer group;
    `token_ids(req, pos)` gives the input ids of the flat tokens (request index and position of each)."""
    table = tables[0]
    R = len(n)
    T = int(n.sum())
    if T == R and R and not build_groups and dense_min_tokens != 1 and int(n.min()) == 1:
        return _decode_layout(starts, total, tables, token_ids, block_size)
    # query_start_loc: [2, 5, 3] -> [0, 2, 7, 10]
    qsl = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(n, out=qsl[1:])
    # req_indices: [2, 5, 3] -> [0,0,1,1,1,1,1,2,2,2]
    req_indices = np.repeat(np.arange(R), n)
    # offset of each token inside its request's chunk: [0,1,0,1,2,3,4,0,1,2]
    offsets = np.arange(T) - qsl[:-1][req_indices]
    positions = starts[req_indices] + offsets
    seq_lens = starts + n
    # slot = block_table[req, pos // bs] * bs + pos % bs
    slot_mapping = table[req_indices, positions // block_size] * block_size + positions % block_size

    groups = []
    if build_groups:
        is_decode = n == 1
        groups = [
            _group(np.nonzero(sel)[0], n, starts, qsl, table, block_size, sliding_window)
            for sel in (is_decode, ~is_decode)
            if sel.any()
        ]

    if dense_min_tokens > 0:
        is_dense = (n >= dense_min_tokens) & (n * (starts + n / 2) >= dense_min_pairs)
    else:
        is_dense = np.zeros(R, dtype=bool)
    dense = [
        _dense_chunk(int(i), int(qsl[i]), int(n[i]), int(starts[i]), table[i], block_size)
        for i in np.nonzero(is_dense)[0]
    ]
    work = _work_items(np.where(is_dense, 0, n), query_tile)

    # A request samples when its scheduled tokens reach the end of its known tokens.
    sample_req = np.nonzero(seq_lens == total)[0]
    return BatchArrays(
        input_ids=token_ids(req_indices, positions),
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=table,
        work=work,
        dense=dense,
        groups=groups,
        sample_rows=qsl[sample_req + 1] - 1,
        sample_req_indices=sample_req,
        kv_groups=_kv_groups(tables, req_indices, positions, block_size, groups, dense) if len(tables) > 1 else [],
    )


class InputBatch:
    """The requests the worker holds, in preallocated arrays: one row (a slot) per request.

    Rows 0 .. num_reqs - 1 are in use, in no particular order; removing a request moves the last
    row into its place, so the rows stay dense. Everything a step needs is kept here and changed
    in place as requests arrive, leave, get blocks and gain tokens: the token ids (prompt, then
    output), counts, block table rows and the sampling parameters as arrays (their SamplingParams
    object is kept too, for the rarely used per-token parts). `prepare` lays out a step's batch
    from the rows the scheduler picked with array operations, no per-request Python.
    Rows that are not in use hold zeros in `block_table` (a row's entries past its blocks are 0).
    """

    def __init__(self, max_model_len: int, block_size: int, capacity: int = 64, num_kv_groups: int = 1) -> None:
        self.block_size = block_size
        # Layer groups of the KV cache: a row's block table holds num_kv_groups ids per block of
        # tokens, interleaved (core/kv_cache_manager.py).
        self.num_kv_groups = num_kv_groups
        cap = max(capacity, 1)
        width = max(max_model_len, 1)
        self.token_ids = np.zeros((cap, width), dtype=np.int64)
        self.num_tokens = np.zeros(cap, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(cap, dtype=np.int64)
        self.num_computed_tokens = np.zeros(cap, dtype=np.int64)
        self.block_table = np.zeros((cap, num_kv_groups * -(-width // block_size)), dtype=np.int64)
        self.num_blocks = np.zeros(cap, dtype=np.int64)
        # Sampling parameters, one entry per row.
        self.temperature = np.zeros(cap, dtype=np.float32)
        self.top_p = np.ones(cap, dtype=np.float32)
        self.top_k = np.zeros(cap, dtype=np.int64)  # 0 = off
        self.min_p = np.zeros(cap, dtype=np.float32)
        self.repetition_penalty = np.ones(cap, dtype=np.float32)
        self.presence_penalty = np.zeros(cap, dtype=np.float32)
        self.frequency_penalty = np.zeros(cap, dtype=np.float32)
        self.min_tokens = np.zeros(cap, dtype=np.int64)
        self.greedy = np.zeros(cap, dtype=bool)
        self.seeded = np.zeros(cap, dtype=bool)
        self.has_token_rules = np.zeros(cap, dtype=bool)  # logit_bias or allowed_token_ids
        self.logprobs = np.full(cap, -1, dtype=np.int64)  # -1 = none
        self.prompt_logprobs = np.full(cap, -1, dtype=np.int64)
        self.req_ids: list[str] = []
        self.req_index: dict[str, int] = {}
        self.params: list[Any] = []
        self.generators: list[Any] = []
        self.eos_token_ids: list[set[int] | frozenset[int]] = []
        # Bumped whenever a row's request or its sampling parameters change: sampling metadata
        # built for the same rows at the same version is still valid.
        self.version = 0

    # ---- arrays ---------------------------------------------------------------------------
    _ROW_ARRAYS = ("num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_blocks", "temperature",
                   "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "min_tokens", "greedy", "seeded", "has_token_rules", "logprobs", "prompt_logprobs")
    _DEFAULTS = {"top_p": 1, "repetition_penalty": 1, "logprobs": -1, "prompt_logprobs": -1}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def _grow_rows(self, need: int) -> None:
        cap = len(self.num_tokens)
        if need <= cap:
            return
        new = max(need, 2 * cap)
        for name in self._ROW_ARRAYS:
            old = getattr(self, name)
            arr = np.full(new, self._DEFAULTS.get(name, 0), dtype=old.dtype)
            arr[:cap] = old
            setattr(self, name, arr)
        for name in ("token_ids", "block_table"):
            old = getattr(self, name)
            arr = np.zeros((new, old.shape[1]), dtype=old.dtype)
            arr[:cap] = old
            setattr(self, name, arr)

    def _grow_cols(self, name: str, need: int) -> None:
        old = getattr(self, name)
        if need <= old.shape[1]:
            return
        arr = np.zeros((old.shape[0], max(need, 2 * old.shape[1])), dtype=old.dtype)
        arr[:, : old.shape[1]] = old
        setattr(self, name, arr)

    # ---- requests -------------------------------------------------------------------------
    def add(
        self,
        req_id: str,
        token_ids: list[int] | np.ndarray,
        num_prompt_tokens: int,
        block_ids: list[int],
        num_computed_tokens: int,
        params: Any,
        generator: Any = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ) -> int:
        """Puts a request in the first free row and returns the row."""
        assert req_id not in self.req_index, req_id
        i = self.num_reqs
        self._grow_rows(i + 1)
        n = len(token_ids)
        self._grow_cols("token_ids", n)
        self.token_ids[i, :n] = token_ids
        self.num_tokens[i] = n
        self.num_prompt_tokens[i] = num_prompt_tokens
        self.num_computed_tokens[i] = num_computed_tokens
        self.num_blocks[i] = 0
        self.append_blocks(i, block_ids)
        self.req_ids.append(req_id)
        self.req_index[req_id] = i
        self.params.append(params)
        self.generators.append(generator)
        self.eos_token_ids.append(eos_token_ids)
        self._set_sampling(i, params)
        self.version += 1
        return i

    def _set_sampling(self, i: int, p: Any) -> None:
        if p is None:  # a batch laid out by hand (tests, tools): nothing to sample with
            for name in self._ROW_ARRAYS[4:]:
                getattr(self, name)[i] = self._DEFAULTS.get(name, 0)
            self.greedy[i] = True
            return
        kind = p.sampling_type
        self.greedy[i] = kind == SamplingType.GREEDY
        self.seeded[i] = kind == SamplingType.RANDOM_SEED
        self.temperature[i] = p.temperature
        self.top_p[i] = p.top_p
        self.top_k[i] = p.top_k
        self.min_p[i] = p.min_p
        self.repetition_penalty[i] = p.repetition_penalty
        self.presence_penalty[i] = p.presence_penalty
        self.frequency_penalty[i] = p.frequency_penalty
        self.min_tokens[i] = p.min_tokens
        self.has_token_rules[i] = bool(p.logit_bias) or p.allowed_token_ids is not None
        self.logprobs[i] = -1 if p.logprobs is None else p.logprobs
        self.prompt_logprobs[i] = -1 if p.prompt_logprobs is None else p.prompt_logprobs

    def remove(self, req_id: str) -> None:
        """Forgets a request (if held); the last row moves into its place."""
        i = self.req_index.pop(req_id, None)
        if i is None:
            return
        last = self.num_reqs - 1
        if i != last:
            moved = self.req_ids[last]
            n = int(self.num_tokens[last])
            self.token_ids[i, :n] = self.token_ids[last, :n]
            self.block_table[i] = self.block_table[last]
            for name in self._ROW_ARRAYS:
                arr = getattr(self, name)
                arr[i] = arr[last]
            for lst in (self.req_ids, self.params, self.generators, self.eos_token_ids):
                lst[i] = lst[last]
            self.req_index[moved] = i
        self.block_table[last, : max(int(self.num_blocks[last]), 0)] = 0
        for lst in (self.req_ids, self.params, self.generators, self.eos_token_ids):
            lst.pop()
        self.version += 1

    def fork(self, parent: int, req_id: str, block_ids: list[int], params: Any, generator: Any = None) -> int:
        """A new row for a sample split off row `parent` after its prompt: the parent's tokens,
        all computed, with its own block ids and sampling parameters."""
        n = int(self.num_tokens[parent])
        return self.add(req_id, self.token_ids[parent, :n], int(self.num_prompt_tokens[parent]), block_ids, n,
                        params, generator, self.eos_token_ids[parent])

    def append_blocks(self, i: int, block_ids: list[int]) -> None:
        k = len(block_ids)
        if k:
            nb = int(self.num_blocks[i])
            self._grow_cols("block_table", nb + k)
            self.block_table[i, nb : nb + k] = block_ids
            self.num_blocks[i] = nb + k

    def truncate_blocks(self, i: int, num_blocks: int) -> None:
        """Cuts row i's block table to its first `num_blocks` entries."""
        nb = int(self.num_blocks[i])
        if num_blocks < nb:
            self.block_table[i, num_blocks:nb] = 0
            self.num_blocks[i] = num_blocks

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Appends one token to each of `rows` (distinct rows)."""
        if len(rows) == 0:
            return
        pos = self.num_tokens[rows]
        self._grow_cols("token_ids", int(pos.max()) + 1)
        self.token_ids[rows, pos] = tokens
        self.num_tokens[rows] = pos + 1

    def extend_tokens(self, i: int, tokens: list[int]) -> None:
        n = int(self.num_tokens[i])
        self._grow_cols("token_ids", n + len(tokens))
        self.token_ids[i, n : n + len(tokens)] = tokens
        self.num_tokens[i] = n + len(tokens)

    def rows_of(self, req_ids: list[str] | Any) -> np.ndarray:
        index = self.req_index
        return np.fromiter((index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    def request_state(self, req_id: str) -> RequestState:
        """The request as a RequestState (a copy: changing it changes nothing here)."""
        i = self.req_index[req_id]
        return RequestState(
            req_id=req_id,
            token_ids=self.token_ids[i, : self.num_tokens[i]].tolist(),
            num_prompt_tokens=int(self.num_prompt_tokens[i]),
            block_ids=self.block_table[i, : self.num_blocks[i]].tolist(),
            num_computed_tokens=int(self.num_computed_tokens[i]),
            sampling_params=self.params[i],
            eos_token_ids=self.eos_token_ids[i],
        )

    def sampling_row(self, i: int) -> Any:
        """Row i as the sampler's per-request view (used where rows are sampled one by one)."""
        from pagedllm.worker.sample.row import SamplingRow

        n, p = int(self.num_tokens[i]), int(self.num_prompt_tokens[i])
        return SamplingRow(params=self.params[i], generator=self.generators[i],
                           prompt_token_ids=self.token_ids[i, :p].tolist(),
                           output_token_ids=self.token_ids[i, p:n].tolist(), eos_token_ids=self.eos_token_ids[i])

    # ---- per step -------------------------------------------------------------------------
    def prepare(
        self,
        rows: np.ndarray,
        num_scheduled: np.ndarray,
        sliding_window: int | None = None,
        build_groups: bool = True,
        query_tile: int = 8,
        dense_min_tokens: int = 0,
        dense_min_pairs: int = 0,
    ) -> BatchArrays:
        """The step's batch for requests in `rows` (in batch order), computing `num_scheduled`
        tokens each from their computed tokens on; equal to `build_batch` on the same requests."""
        n = np.asarray(num_scheduled, dtype=np.int64)
        starts = self.num_computed_tokens[rows]
        width = max(int(self.num_blocks[rows].max()), 1) if len(rows) else 1
        table = self.block_table[rows, :width]
        token_ids = self.token_ids
        tables = _group_tables(table, self.num_kv_groups)
        return _layout(n, starts, self.num_tokens[rows], tables, lambda req, pos: token_ids[rows[req], pos],
                       self.block_size, sliding_window, build_groups, query_tile, dense_min_tokens,
                       dense_min_pairs)


def _decode_layout(
    starts: np.ndarray,
    total: np.ndarray,
    tables: list[np.ndarray],
    token_ids: Callable[[np.ndarray, np.ndarray], np.ndarray],
    block_size: int,
) -> BatchArrays:
    """`_layout` of a decode-only batch (one token per request, no groups, nothing dense), with
    the general case's arrays written down directly: request i's token is flat row i, at
    position starts[i]; one work item (i, 0, 1) per request."""
    table = tables[0]
    R = len(starts)
    idx = np.arange(R + 1)
    req = idx[:R]
    positions = starts.copy()
    seq_lens = starts + 1
    work = np.zeros((R, 3), dtype=np.int64)
    work[:, 0] = req
    work[:, 2] = 1
    sample_req = np.nonzero(seq_lens == total)[0]
    return BatchArrays(
        input_ids=token_ids(req, positions),
        positions=positions,
        slot_mapping=table[req, positions // block_size] * block_size + positions % block_size,
        query_start_loc=idx,
        seq_lens=seq_lens,
        block_tables=table,
        work=work,
        dense=[],
        groups=[],
        sample_rows=sample_req,
        sample_req_indices=sample_req,
        kv_groups=_kv_groups(tables, req, positions, block_size, [], []) if len(tables) > 1 else [],
    )


def token_rows(batch: BatchArrays) -> BatchArrays:
    """The batch with every token as a request of its own that decodes one token at its position
    (the request's block table row, keys up to that position): how the native decode step, which
    takes one token per row, runs a step whose requests verify proposed tokens. Its rows write
    K/V that later rows of the same request read in the same layer (the kernel orders them)."""
    T = len(batch.input_ids)
    req = np.repeat(np.arange(len(batch.seq_lens)), np.diff(batch.query_start_loc))
    rows = np.arange(T)
    return BatchArrays(
        input_ids=batch.input_ids,
        positions=batch.positions,
        slot_mapping=batch.slot_mapping,
        query_start_loc=np.arange(T + 1),
        seq_lens=batch.positions + 1,
        block_tables=np.ascontiguousarray(batch.block_tables[req]),
        work=np.stack([rows, np.zeros(T, dtype=np.int64), np.ones(T, dtype=np.int64)], axis=1),
        dense=[],
        groups=[],
        sample_rows=rows,
        sample_req_indices=rows,
    )


def _dense_chunk(req: int, query_start: int, qlen: int, start: int, blocks: np.ndarray,
                 block_size: int) -> DenseChunk:
    """The chunk's context blocks; the attention applies causality and any sliding window itself."""
    seq_len = start + qlen
    return DenseChunk(query_start, qlen, blocks[: -(-seq_len // block_size)].copy(), seq_len, req)


def _work_items(n: np.ndarray, tile: int) -> np.ndarray:
    """Splits each request's query tokens into tiles of at most `tile` tokens (none for n = 0).

    n = [1, 19, 2], tile 8 -> (req, first, count): (0,0,1) (1,0,8) (1,8,8) (1,16,3) (2,0,2)
    """
    tiles = -(-n // tile)
    req = np.repeat(np.arange(len(n)), tiles)
    starts = np.zeros(len(n), dtype=np.int64)
    np.cumsum(tiles[:-1], out=starts[1:])
    first = (np.arange(len(req)) - starts[req]) * tile
    count = np.minimum(tile, n[req] - first)
    return np.stack([req, first, count], axis=1).astype(np.int64)


def _group(
    reqs: np.ndarray,
    n: np.ndarray,
    starts: np.ndarray,
    qsl: np.ndarray,
    table: np.ndarray,
    block_size: int,
    sliding_window: int | None,
) -> GroupArrays:
    B = len(reqs)
    qlen = n[reqs]
    max_q = int(qlen.max())
    seq = starts[reqs] + qlen
    nblocks = int(-(-seq.max() // block_size))
    L = nblocks * block_size
    T = int(qsl[-1])
    q_off = np.arange(max_q)
    valid = q_off[None, :] < qlen[:, None]  # [B, max_q]
    # Flat index of each padded query slot; padding points at row T (the zero row).
    qidx = np.where(valid, qsl[reqs][:, None] + q_off[None, :], T)
    # Query at offset j of request b sits at position starts[b] + j and sees keys 0..that position.
    qpos = starts[reqs][:, None] + q_off[None, :]  # [B, max_q]
    kpos = np.arange(L)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & valid[:, :, None]
    if sliding_window:
        mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
    flat_valid = valid.reshape(-1)
    return GroupArrays(
        batch_size=B,
        max_query_len=max_q,
        query_index=qidx.reshape(-1),
        out_rows=np.nonzero(flat_valid)[0],
        out_dest=qidx.reshape(-1)[flat_valid],
        block_tables=table[reqs, :nblocks],
        mask=mask[:, None, :, :],
        reqs=reqs,
    )
