"""The persistent input batch against the per-request reference (`build_batch` over RequestState):
a seeded random run of adds, removals, forks, new tokens and new or replaced blocks, after which
every step's arrays and sampling metadata must be exactly those built the old way."""

from __future__ import annotations

import random
from dataclasses import fields

import numpy as np
import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, RequestState, build_batch
from pagedllm.worker.sample import Sampler, SamplingMetadata, SamplingRow

BS = 4
V = 50


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    if kind < 0.4:
        return SamplingParams(temperature=0.0, logprobs=rng.choice([None, 2]))
    return SamplingParams(
        temperature=rng.choice([0.5, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]),
        min_p=rng.choice([0.0, 0.1]),
        seed=rng.choice([None, 7]),
        repetition_penalty=rng.choice([1.0, 1.2]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, 0.3]),
        min_tokens=rng.choice([0, 3]),
        logprobs=rng.choice([None, 1]),
        prompt_logprobs=rng.choice([None, 2]),
        logit_bias=rng.choice([None, {3: 1.5}]),
        allowed_token_ids=rng.choice([None, [1, 2, 3, 4]]),
        stop_token_ids=rng.choice([[], [9]]),
    )


def assert_same_batch(a: object, b: object) -> None:
    for f in fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        elif isinstance(x, list):
            assert len(x) == len(y), f.name
            for u, v in zip(x, y):
                if isinstance(u, np.ndarray):
                    assert np.array_equal(u, v), f.name
                else:
                    assert_same_batch(u, v)
        else:
            assert x == y, f.name


def assert_same_metadata(a: SamplingMetadata, b: SamplingMetadata) -> None:
    def same(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, tuple):
            return isinstance(y, tuple) and all(same(u, v) for u, v in zip(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(x[k] is y[k] for k in x)  # type: ignore[union-attr]
        if x is not None and hasattr(x, "__dataclass_fields__"):
            return all(same(getattr(x, f.name), getattr(y, f.name)) for f in fields(x))  # type: ignore[arg-type]
        return x == y

    for f in fields(a):
        assert same(getattr(a, f.name), getattr(b, f.name)), f.name


@pytest.mark.parametrize("seed", range(3))
def test_persistent_batch_matches_per_request_reference(seed: int) -> None:
    rng = random.Random(seed)
    ib = InputBatch(max_model_len=24, block_size=BS, capacity=2)  # small: rows and columns must grow
    ref: dict[str, RequestState] = {}
    gens: dict[str, torch.Generator] = {}
    next_block = iter(range(1, 10**6))
    counter = iter(range(10**6))

    def add(rid: str, tokens: list[int], num_prompt: int, computed: int, params: SamplingParams) -> None:
        blocks = [next(next_block) for _ in range(-(-len(tokens) // BS) + rng.randint(0, 2))]
        gen = torch.Generator().manual_seed(7) if params.seed is not None else None
        if gen is not None:
            gens[rid] = gen
        ib.add(rid, tokens, num_prompt, blocks, computed, params, gen, {0})
        ref[rid] = RequestState(rid, list(tokens), num_prompt, list(blocks), computed, params, {0})

    for _ in range(300):
        op = rng.random()
        if op < 0.25 or not ref:
            n = rng.randint(1, 30)
            add(f"r{next(counter)}", [rng.randrange(V) for _ in range(n)], rng.randint(1, n),
                rng.randint(0, n - 1), random_params(rng))
        elif op < 0.4:
            rid = rng.choice(sorted(ref))
            ib.remove(rid)
            del ref[rid]
            ib.remove("never-added")  # forgetting an unknown request is a no-op
        elif op < 0.5:  # a fork: the parent's tokens, all computed, with its own blocks and params
            parent = ref[rng.choice(sorted(ref))]
            rid = f"r{next(counter)}"
            params = random_params(rng)
            blocks = [next(next_block) for _ in range(len(parent.block_ids))]
            gen = torch.Generator().manual_seed(7) if params.seed is not None else None
            ib.fork(ib.req_index[parent.req_id], rid, blocks, params, gen)
            ref[rid] = RequestState(rid, list(parent.token_ids), parent.num_prompt_tokens, blocks,
                                    len(parent.token_ids), params, parent.eos_token_ids)
        elif op < 0.65:  # one sampled token for some requests, as the runner appends them
            rids = rng.sample(sorted(ref), rng.randint(1, len(ref)))
            toks = [rng.randrange(V) for _ in rids]
            ib.append_tokens(ib.rows_of(rids), np.asarray(toks, dtype=np.int64))
            for rid, t in zip(rids, toks):
                ref[rid].token_ids.append(t)
        elif op < 0.75:  # tokens learned from the driver (tensor-parallel ranks)
            rid = rng.choice(sorted(ref))
            toks = [rng.randrange(V) for _ in range(rng.randint(1, 3))]
            ib.extend_tokens(ib.req_index[rid], toks)
            ref[rid].token_ids.extend(toks)
        else:  # new blocks, a copy-on-write replacement, progress
            rid = rng.choice(sorted(ref))
            i, s = ib.req_index[rid], ref[rid]
            new = [next(next_block) for _ in range(rng.randint(0, 3))]
            if s.block_ids and rng.random() < 0.5:
                j, b = rng.randrange(len(s.block_ids)), next(next_block)
                ib.block_table[i, j] = b
                s.block_ids[j] = b
            ib.append_blocks(i, new)
            s.block_ids.extend(new)
            s.num_computed_tokens = rng.randint(0, len(s.token_ids) - 1)
            ib.num_computed_tokens[i] = s.num_computed_tokens

        assert sorted(ib.req_ids) == sorted(ref) and len(ib.req_index) == ib.num_reqs
        for rid, s in ref.items():
            assert ib.request_state(rid) == s
        # Rows past the live ones hold no blocks.
        assert not ib.block_table[ib.num_reqs :].any()

        # A step over a random subset, in random order; the blocks must cover the chunk.
        rids = rng.sample(sorted(ref), rng.randint(1, len(ref)))
        rids = [r for r in rids if len(ref[r].block_ids) * BS >= len(ref[r].token_ids) > ref[r].num_computed_tokens]
        if not rids:
            continue
        n = [rng.randint(1, len(ref[r].token_ids) - ref[r].num_computed_tokens) for r in rids]
        opts = dict(sliding_window=rng.choice([None, 5]), build_groups=rng.random() < 0.5, query_tile=4,
                    dense_min_tokens=rng.choice([0, 3]), dense_min_pairs=4)
        got = ib.prepare(ib.rows_of(rids), np.asarray(n), **opts)
        want = build_batch([ref[r] for r in rids], n, BS, **opts)
        assert_same_batch(got, want)

        rows = ib.rows_of(rids)
        sampling_rows = [SamplingRow(ref[r].sampling_params, gens.get(r) if ref[r].sampling_params.seed is not None
                                     else None, ref[r].prompt_token_ids, ref[r].output_token_ids,
                                     ref[r].eos_token_ids) for r in rids]
        for r, row in zip(rids, sampling_rows):  # the batch's generator, the same object the runner keeps
            row.generator = ib.generators[ib.req_index[r]]
        assert_same_metadata(SamplingMetadata.from_batch(ib, rows, V, torch.device("cpu")),
                             SamplingMetadata.from_rows(sampling_rows, V, torch.device("cpu")))


def test_reused_static_metadata_tracks_tokens() -> None:
    """The parameter part of the metadata is built once; min_tokens and penalties follow the tokens."""
    ib = InputBatch(max_model_len=16, block_size=BS)
    p = SamplingParams(temperature=0.0, min_tokens=2, frequency_penalty=1.0)
    ib.add("a", [5, 6, 7], 3, [1], 0, p, None, {0})
    rows = np.asarray([0])
    static = SamplingMetadata.static_from_batch(ib, rows, V, torch.device("cpu"))
    assert static.min_tokens_index is None and static.penalties is None and static.all_greedy
    md = static.with_token_state(ib, rows, torch.device("cpu"))
    assert md.min_tokens_index is not None and md.penalties is not None
    assert md.penalties.output_token_ids.shape == (1, 0)
    ib.append_tokens(rows, np.asarray([9]))
    ib.append_tokens(rows, np.asarray([9]))
    md = static.with_token_state(ib, rows, torch.device("cpu"))
    assert md.min_tokens_index is None  # two outputs: min_tokens reached
    assert md.penalties is not None and md.penalties.output_token_ids.tolist() == [[9, 9]]
    logits = torch.zeros(1, V)
    logits[0, 9] = 1.5  # penalised by 2 x 1.0 below token 1's 0.1
    logits[0, 1] = 0.1
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1]


@pytest.mark.parametrize("query_tile", [1, 8])
def test_decode_only_layout_is_the_general_one(query_tile: int) -> None:
    """A decode-only step takes a shortcut in the layout; it must give the general layout's arrays
    (which a dense threshold of one token, with a pair threshold no request reaches, forces)."""
    rng = random.Random(5)
    states = []
    for i in range(7):
        n = rng.randint(1, 40)
        done = n - rng.choice([1, 1, 2])  # some requests still have a prompt token after this one
        states.append(RequestState(f"r{i}", list(range(100 + i, 100 + i + n)), max(done, 1), list(range(i * 12, i * 12 + 11)),
                                   done, SamplingParams()))
    fast = build_batch(states, [1] * len(states), BS, None, build_groups=False, query_tile=query_tile)
    general = build_batch(states, [1] * len(states), BS, None, build_groups=False, query_tile=query_tile,
                          dense_min_tokens=1, dense_min_pairs=1 << 40)
    assert_same_batch(fast, general)
    assert len(fast.sample_rows) < len(states)  # both kinds of rows are in the batch


@pytest.mark.parametrize("build_groups", [True, False])
def test_kv_layer_groups_read_their_own_block_tables(build_groups: bool) -> None:
    """With 3 KV layer groups (block ids interleaved, core/kv_cache_manager.py) each group's slot
    mapping, block tables, attention groups' tables and dense chunks' blocks are those of a batch
    laid out from that group's ids alone; the persistent batch gives the same."""
    G = 3
    rng = random.Random(4)
    states, counts = [], []
    for r, (num_tokens, computed) in enumerate([(13, 0), (9, 8), (30, 12), (6, 5)]):
        nblocks = -(-num_tokens // BS)
        ids = [rng.randrange(1, 500) for _ in range(G * nblocks)]
        states.append(RequestState(f"r{r}", list(range(num_tokens)), num_tokens, ids, computed, None))
        counts.append(num_tokens - computed)
    opts = {"build_groups": build_groups, "dense_min_tokens": 10}
    batch = build_batch(states, counts, BS, num_kv_groups=G, **opts)
    ib = InputBatch(max_model_len=64, block_size=BS, capacity=2, num_kv_groups=G)
    for s in states:
        ib.add(s.req_id, s.token_ids, s.num_prompt_tokens, s.block_ids, s.num_computed_tokens, None)
    assert_same_batch(ib.prepare(ib.rows_of([s.req_id for s in states]), np.asarray(counts), **opts), batch)
    assert len(batch.kv_groups) == G - 1 and batch.dense
    for g in range(G):
        alone = build_batch([RequestState(s.req_id, s.token_ids, s.num_prompt_tokens, s.block_ids[g::G],
                                          s.num_computed_tokens, None) for s in states], counts, BS, **opts)
        if g == 0:
            want = (batch.slot_mapping, batch.block_tables, [x.block_tables for x in batch.groups],
                    [d.blocks for d in batch.dense])
        else:
            kg = batch.kv_groups[g - 1]
            want = (kg.slot_mapping, kg.block_tables, kg.group_block_tables, kg.dense_blocks)
        got = (alone.slot_mapping, alone.block_tables, [x.block_tables for x in alone.groups],
               [d.blocks for d in alone.dense])
        for w, a in zip(want[:2], got[:2]):
            assert np.array_equal(w, a)
        for ws, as_ in zip(want[2:], got[2:]):
            assert len(ws) == len(as_) and all(np.array_equal(w, a) for w, a in zip(ws, as_))
