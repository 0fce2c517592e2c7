"""Per-step model inputs in numpy: token ids, positions, slot mapping, attention groups.

Everything here is computed once per step, on the CPU, without torch, so it can be tested on
its own and so no layer ever loops over requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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


@dataclass
class DenseChunk:
    """One long prompt chunk attended densely: its context is gathered once per layer."""

    query_start: int  # first row of the chunk in the flat batch
    query_len: int
    blocks: np.ndarray  # [ceil(seq_len / block_size)] block ids of the context, in order
    seq_len: int  # keys 0 .. seq_len - 1 (the cached context plus the chunk itself)
    # [query_len, seq_len] bool, True where a query may see a key; only with a sliding window
    # (without one, the chunk is causal after its cached context and needs no mask).
    mask: np.ndarray | None


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


def build_batch(
    states: list[RequestState],
    num_scheduled: list[int],
    block_size: int,
    sliding_window: int | None = None,
    build_groups: bool = True,
    query_tile: int = 8,
    dense_min_tokens: int = 0,
    dense_min_pairs: int = 0,
) -> BatchArrays:
    """`dense_min_tokens` > 0: chunks of at least that many tokens, with at least `dense_min_pairs`
    query-key pairs (causal), are attended densely."""
    R = len(states)
    n = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.asarray([s.num_computed_tokens for s in states], dtype=np.int64)
    T = int(n.sum())
    # query_start_loc: [2, 5, 3] -> [0, 2, 7, 10]
    qsl = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(n, out=qsl[1:])
    # req_indices: [2, 5, 3] -> [0,0,1,1,1,1,1,2,2,2]
    req_indices = np.repeat(np.arange(R), n)
    # offset of each token inside its request's chunk: [0,1,0,1,2,3,4,0,1,2]
    offsets = np.arange(T) - qsl[:-1][req_indices]
    positions = starts[req_indices] + offsets
    seq_lens = starts + n

    max_blocks = max((len(s.block_ids) for s in states), default=1)
    table = np.zeros((R, max(max_blocks, 1)), dtype=np.int64)
    for i, s in enumerate(states):
        table[i, : len(s.block_ids)] = s.block_ids
    # slot = block_table[req, pos // bs] * bs + pos % bs
    slot_mapping = table[req_indices, positions // block_size] * block_size + positions % block_size

    input_ids = np.empty(T, dtype=np.int64)
    for i, s in enumerate(states):
        input_ids[qsl[i] : qsl[i + 1]] = s.token_ids[starts[i] : starts[i] + n[i]]

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
        _dense_chunk(int(qsl[i]), int(n[i]), int(starts[i]), table[i], block_size, sliding_window)
        for i in np.nonzero(is_dense)[0]
    ]
    work = _work_items(np.where(is_dense, 0, n), query_tile)

    # A request samples when its scheduled tokens reach the end of its known tokens.
    total = np.asarray([len(s.token_ids) for s in states], dtype=np.int64)
    sample_req = np.nonzero(seq_lens == total)[0]
    return BatchArrays(
        input_ids=input_ids,
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
    )


def _dense_chunk(
    query_start: int, qlen: int, start: int, blocks: np.ndarray, block_size: int, sliding_window: int | None
) -> DenseChunk:
    seq_len = start + qlen
    mask = None
    if sliding_window:
        # Query j sits at position start + j and sees keys start + j - window + 1 .. start + j:
        # start 3, qlen 2, window 3 -> rows [0,1,1,1,0], [0,0,1,1,1].
        qpos = start + np.arange(qlen)[:, None]
        kpos = np.arange(seq_len)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - sliding_window)
    return DenseChunk(query_start, qlen, blocks[: -(-seq_len // block_size)].copy(), seq_len, mask)


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
    )
