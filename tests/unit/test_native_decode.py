"""The fused native decode step against the torch path of the same model runner.

Both read the same weights and KV cache; bf16 follows the torch path's rounding points and uses
the same small-M GEMM blocking, so up to small_m_rows(bfloat16) rows it agrees to the bit. float32
differs only in the order of GEMM sums (MKL's or oneDNN's against the kernel's), a few float32 ulps
per layer. float16 (builds with F16C) runs its norms and SiLU in the step's scalar loops with
the torch path's rounding points, but their float32 sums differ from torch's in the last bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams, native
from pagedllm.hardware import cpu_flags
from pagedllm.native import kernels
from pagedllm.worker import native_decode
from pagedllm.models.testing import make_tiny_checkpoint
from pagedllm.worker.input_batch import RequestState, build_batch
from pagedllm.layers.native_linear import AVX512_FORM, small_m_rows
from pagedllm.worker.native_decode import StallGuard, argmax_rows, load_decode_kernel

pytestmark = pytest.mark.skipif(
    load_decode_kernel() is None or not load_decode_kernel().small_m_available() & 1,
    reason="no C compiler, or neither AVX-512 nor AVX2 with FMA")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "llama"), arch="llama", seed=3, tie=True)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3: heads of 32 (q wider than the hidden size), random q/k norm weights."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "qwen3"), arch="qwen3", seed=5, tie=True)


def _needs_bf16(dtype: str) -> None:
    """Skip a 16-bit dtype whose GEMM kernel this build lacks."""
    if dtype == "bfloat16" and not load_decode_kernel().small_m_available() & 2:
        pytest.skip("no bf16 GEMM kernel on this CPU (AVX-512 without AVX-512 BF16)")
    if dtype == "float16" and not load_decode_kernel().small_m_available() & 8:
        pytest.skip("no float16 GEMM kernel in this build (a CPU without F16C)")


def _runner(model_dir: str, dtype: str):
    llm = LLM(model=model_dir, dtype=dtype, num_kv_blocks=2048, block_size=16)
    return llm, llm.llm_engine.core.executor.runner


def _decode_batch(runner, seq_lens: list[int], seed: int):
    """A decode step of len(seq_lens) requests over random context already in the KV cache."""
    rng = np.random.default_rng(seed)
    states, next_block = [], 0
    for i, n in enumerate(seq_lens):
        nblocks = -(-n // runner.block_size)
        blocks = list(range(next_block, next_block + nblocks))
        next_block += nblocks
        tokens = rng.integers(5, 300, n).tolist()
        states.append(RequestState(f"r{i}", tokens, n - 1, blocks, n - 1, SamplingParams()))
    for kv in runner.kv_caches:
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)).to(kv.dtype))
    return build_batch(states, [1] * len(states), runner.block_size, None, **runner.batch_options)


def _both_paths(runner, batch):
    """(torch hidden, torch KV), (native hidden, native KV), each from the same starting cache."""
    start = [kv.clone() for kv in runner.kv_caches]
    nd = runner.native_decode
    with torch.inference_mode():
        ref = runner.paths.eager.forward(batch)
    ref_kv = [kv.clone() for kv in runner.kv_caches]
    for kv, s in zip(runner.kv_caches, start):
        kv.copy_(s)
    out = nd.run(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)
    return (ref, ref_kv), (out, [kv.clone() for kv in runner.kv_caches])


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fused_step_matches_torch_path(arch, dtype, tiny_model_dir, tiny_llama_dir, tiny_qwen3_dir, one_torch_thread):
    _needs_bf16(dtype)
    llm, runner = _runner({"qwen2": tiny_model_dir, "llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}[arch], dtype)
    assert runner.native_decode is not None
    max_rows = runner.native_decode.max_rows
    assert max_rows == {"float32": 32 if AVX512_FORM else 128, "bfloat16": 256, "float16": 128 if AVX512_FORM else 256}[dtype]
    # Past the kernel's rows (float32) the torch path runs oneDNN's GEMMs, the fused step its own.
    kernel_rows = small_m_rows(runner.dtype)
    for rows in sorted({1, 3, 4, min(kernel_rows, max_rows), min(kernel_rows + 1, max_rows), max_rows}):
        batch = _decode_batch(runner, [5 + 29 * i % 90 for i in range(rows)], seed=rows)
        (ref, ref_kv), (out, out_kv) = _both_paths(runner, batch)
        assert out is not None and out.dtype == ref.dtype and out.shape == ref.shape
        same_gemm = dtype == "float32" or rows <= small_m_rows(runner.dtype)
        for a, b in zip(out_kv, ref_kv):  # the step's K (after RoPE) and V went to the same slots
            if dtype == "float16":
                # float16's norms and SiLU are the step's scalar loops, against torch's ops: their
                # float32 sums and exp differ in the last bits, so a float16 rounding (2^-11
                # relative) goes the other way here and there (measured: the same bits at 1-4 rows,
                # 99.8 % of the outputs at 256, the rest one float16 ulp apart). Past the kernel's
                # rows oneDNN's QKV sums in another order too, and RoPE's differences of products
                # turn an ulp of q or k (2^-10 at 1-2) into as much in a small entry (2 of 4M
                # entries at 128 rows: 2^-9).
                torch.testing.assert_close(a.float(), b.float(), rtol=2**-8, atol=2**-10 if same_gemm else 2**-8)
            elif same_gemm:
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)
            else:  # oneDNN's QKV sums in another order: an ulp (2^-8) here and there, through RoPE
                torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-8)
        if dtype == "float16":
            torch.testing.assert_close(out.float(), ref.float(), rtol=2**-8, atol=2**-9)
        elif dtype == "bfloat16" and rows <= small_m_rows(runner.dtype):
            # Same kernel blocking and rounding points: bit for bit.
            assert torch.equal(out, ref)
        elif dtype == "bfloat16":
            # oneDNN's GEMM sums in another order above the kernel's rows: bf16 outputs then differ
            # by an ulp here and there (2^-8 relative), and a few such differences add up over the layers.
            torch.testing.assert_close(out.float(), ref.float(), rtol=2**-5, atol=2**-5)
        else:
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not AVX512_FORM or "f16c" not in cpu_flags(), reason="this CPU's own build is the AVX2 form")
def test_avx2_form_float16_step_matches_torch_path(monkeypatch, tiny_model_dir, one_torch_thread):
    """The fused step built in its AVX2 + FMA + F16C form on a CPU with AVX-512 (every AVX-512 subset
    off), against the torch path of this CPU's build, in float16, with the float16 tolerance of
    test_fused_step_matches_torch_path: the two GEMM forms sum in different orders (8 lanes
    against 16), so outputs and KV entries differ by a float16 rounding here and there."""
    cdll = native.compile_native(native.CSRC / kernels.DECODE.source, native.AVX2_FORM_FLAGS)
    lib = None if cdll is None else native.bind(cdll, kernels.DECODE)
    if lib is None:
        pytest.skip("no C compiler")
    assert lib.small_m_available() & 8 and not lib.small_m_available() & 16  # float16, not the AVX-512 form
    monkeypatch.setattr(native_decode, "load_decode_kernel", lambda: lib)
    llm, runner = _runner(tiny_model_dir, "float16")
    assert runner.native_decode is not None and runner.native_decode.lib is lib
    for rows in (1, 3, 5, runner.native_decode.max_rows):
        batch = _decode_batch(runner, [5 + 29 * i % 90 for i in range(rows)], seed=40 + rows)
        (ref, ref_kv), (out, out_kv) = _both_paths(runner, batch)
        assert out is not None and out.dtype == ref.dtype == torch.float16
        for a, b in zip(out_kv, ref_kv):
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-8, atol=2**-10)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-8, atol=2**-9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_step_in_a_team_of_threads_gives_the_one_thread_bits(dtype, tiny_model_dir, one_torch_thread):
    """With two threads the step runs in one OpenMP team, each thread its share of every GEMM row,
    attention head and elementwise run: each output element is computed as on one thread, so the
    hidden states, the KV cache, the logits and the argmax are the one-thread step's."""
    _needs_bf16(dtype)
    llm, runner = _runner(tiny_model_dir, dtype)
    for rows in (1, 3, runner.native_decode.max_rows):
        assert_team_gives_one_thread_bits(runner, _decode_batch(runner, [4 + 37 * i % 80 for i in range(rows)],
                                                                seed=20 + rows))


def assert_team_gives_one_thread_bits(runner, batch) -> None:
    """The step's hidden states, KV cache, logits and argmax on two threads are those on one."""
    nd = runner.native_decode
    rows = len(batch.input_ids)
    args = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)
    sample = np.arange(rows)[::-1].copy()
    start = [kv.clone() for kv in runner.kv_caches]
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out = []
        for call in (lambda: nd.run(*args), lambda: nd.run_head(*args, sample, greedy=False),
                     lambda: nd.run_head(*args, sample, greedy=True)):
            for kv, s in zip(runner.kv_caches, start):
                kv.copy_(s)
            out.append(call())
        results.append((out, [kv.clone() for kv in runner.kv_caches]))
    torch.set_num_threads(1)
    (one, one_kv), (two, two_kv) = results
    assert all(torch.equal(a, b) for a, b in zip(one_kv, two_kv))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert one[2].tolist() == two[2].tolist() == one[1].argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_one_thread_steps_of_the_stall_guard_give_the_team_bits(dtype, tiny_model_dir, one_torch_thread):
    """While the stall guard runs the step on one thread under torch's two, the hidden states, the
    KV cache and the logits are the team's, and torch's thread count is the same after the call."""
    _needs_bf16(dtype)
    llm, runner = _runner(tiny_model_dir, dtype)
    nd = runner.native_decode
    torch.set_num_threads(2)
    nd.guard = StallGuard(2)
    batch = _decode_batch(runner, [5, 40, 71], seed=31)
    args = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)
    start = [kv.clone() for kv in runner.kv_caches]
    results = []
    for solo in (False, True):
        nd.guard.solo_left = 2 * solo
        out = []
        for call in (lambda: nd.run(*args), lambda: nd.run_head(*args, np.arange(3), greedy=False)):
            for kv, s in zip(runner.kv_caches, start):
                kv.copy_(s)
            out.append(call())
            assert nd.model.threads == int(solo) and torch.get_num_threads() == 2
        results.append((out, [kv.clone() for kv in runner.kv_caches]))
    torch.set_num_threads(1)
    (team, team_kv), (solo_out, solo_kv) = results
    assert all(torch.equal(a, b) for a, b in zip(team_kv, solo_kv))
    assert torch.equal(team[0], solo_out[0]) and torch.equal(team[1], solo_out[1])


def test_generation_is_the_same_with_and_without_the_fused_step(tiny_model_dir, one_torch_thread):
    llm, runner = _runner(tiny_model_dir, "float32")
    prompts = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (3, 17, 40, 9, 33)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=2) for m in (30, 12, 25, 40, 8)]
    fused = llm.generate(prompts, params, use_tqdm=False)
    nd, runner.native_decode = runner.native_decode, None
    plain = llm.generate(prompts, params, use_tqdm=False)
    runner.native_decode = nd
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)


@pytest.mark.parametrize("head", [False, True])
def test_declined_step_leaves_the_cache_untouched(head, tiny_model_dir, one_torch_thread):
    llm, runner = _runner(tiny_model_dir, "float32")
    batch = _decode_batch(runner, [10, 20], seed=1)
    batch.positions[1] = runner.model_config.max_model_len + 10_000  # past the RoPE table
    before = [kv.clone() for kv in runner.kv_caches]
    args = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)
    nd = runner.native_decode
    assert (nd.run_head(*args, np.asarray([0, 1]), greedy=True) if head else nd.run(*args)) is None
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))


@pytest.mark.parametrize("kwargs", [{"dtype": "float32", "kv_cache_dtype": "bfloat16"},
                                    {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"}])
def test_configurations_it_does_not_cover_run_the_torch_path(kwargs, tiny_model_dir, one_torch_thread):
    llm = LLM(model=tiny_model_dir, num_kv_blocks=16, **kwargs)
    assert llm.llm_engine.core.executor.runner.native_decode is None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_switch_off(tiny_model_dir, monkeypatch, one_torch_thread):
    monkeypatch.setenv("PAGEDLLM_NATIVE_DECODE", "0")
    load_decode_kernel.cache_clear()
    try:
        llm = LLM(model=tiny_model_dir, dtype="float32", num_kv_blocks=16)
        assert llm.llm_engine.core.executor.runner.native_decode is None
    finally:
        load_decode_kernel.cache_clear()


def _head_calls(runner, monkeypatch) -> list[str]:
    """Records what each native LM-head step returned: "tokens", "logits" or "declined"."""
    calls: list[str] = []
    run_head = runner.native_decode.run_head

    def spy(*args, **kwargs):
        out = run_head(*args, **kwargs)
        calls.append("declined" if out is None else "tokens" if isinstance(out, np.ndarray) else "logits")
        return out

    monkeypatch.setattr(runner.native_decode, "run_head", spy)
    return calls


def head_three_ways(runner, nd, batch, sample: list[int]):
    """(the torch LM head's logits on the fused step's hidden states, the fused head's logits, its
    argmax tokens), each from the same starting cache."""
    start = [kv.clone() for kv in runner.kv_caches]
    args = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)
    with torch.inference_mode():
        ref = runner.model.compute_logits(nd.run(*args)[torch.tensor(sample)])
    for kv, s in zip(runner.kv_caches, start):
        kv.copy_(s)
    logits = nd.run_head(*args, np.asarray(sample), greedy=False)
    for kv, s in zip(runner.kv_caches, start):
        kv.copy_(s)
    return ref, logits, nd.run_head(*args, np.asarray(sample), greedy=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_on_to_the_lm_head_gives_the_lm_heads_logits(dtype, tiny_llama_dir, one_torch_thread):
    _needs_bf16(dtype)
    llm, runner = _runner(tiny_llama_dir, dtype)
    nd = runner.native_decode
    assert nd.has_head
    for rows, sample in ((1, [0]), (3, [2, 0]), (4, [0, 1, 2, 3])):
        batch = _decode_batch(runner, [7 + 23 * i % 70 for i in range(rows)], seed=10 + rows)
        ref, logits, tokens = head_three_ways(runner, nd, batch, sample)
        assert logits.dtype == torch.float32 and torch.equal(logits, ref)
        assert tokens.tolist() == ref.argmax(dim=-1).tolist()
        if dtype == "bfloat16":  # and, up to four rows, what the torch path's forward and head give
            (torch_hidden, _), _ = _both_paths(runner, batch)
            assert torch.equal(runner.model.compute_logits(torch_hidden[torch.tensor(sample)]), logits)


def _generate_both(llm, runner, prompts, params):
    fused = llm.generate(prompts, params, use_tqdm=False)
    nd, runner.native_decode = runner.native_decode, None
    try:
        plain = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.native_decode = nd
    return fused, plain


def test_bf16_generation_through_the_head_step_is_the_torch_paths(tiny_llama_dir, monkeypatch, one_torch_thread):
    """Greedy rows get their tokens from the native argmax; a batch with a seeded random row, a
    penalty or logprobs gets logits from the same call and samples in torch: every token and
    logprob is the torch path's (bf16, at most four rows: bit for bit)."""
    _needs_bf16("bfloat16")
    llm, runner = _runner(tiny_llama_dir, "bfloat16")
    calls = _head_calls(runner, monkeypatch)
    prompts = [{"prompt_token_ids": list(range(11, 11 + n))} for n in (5, 19, 33)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    fused, plain = _generate_both(llm, runner, prompts, greedy)
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]
    assert calls and set(calls) == {"tokens"}
    calls.clear()
    mixed = [greedy, SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3, ignore_eos=True)]
    fused, plain = _generate_both(llm, runner, prompts, mixed)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert "logits" in calls and "declined" not in calls


def test_default_model_bf16_greedy_is_the_torch_paths(monkeypatch):
    _needs_bf16("bfloat16")
    llm = LLM(dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    runner = llm.llm_engine.core.executor.runner
    calls = _head_calls(runner, monkeypatch)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    fused, plain = _generate_both(llm, runner, prompts, SamplingParams(max_tokens=24, temperature=0))
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in fused] == [o.outputs[0].text for o in plain]
    assert set(calls) == {"tokens"}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_argmax_takes_the_first_of_tied_logits_and_a_nan_as_torch_does(dtype, threads, tiny_llama_dir,
                                                                              one_torch_thread):
    """With two threads each takes half of the vocabulary: the ties and the NaN span both halves."""
    _needs_bf16(dtype)
    torch.set_num_threads(threads)
    llm, runner = _runner(tiny_llama_dir, dtype)
    nd, head = runner.native_decode, runner.model.lm_head.weight
    batch = _decode_batch(runner, [9, 30, 17], seed=4)
    args = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens,
            np.arange(3))
    start = [kv.clone() for kv in runner.kv_caches]

    def tokens_and_ref() -> tuple[list[int], list[int]]:
        for kv, s in zip(runner.kv_caches, start):
            kv.copy_(s)
        logits = nd.run_head(*args, greedy=False)
        for kv, s in zip(runner.kv_caches, start):
            kv.copy_(s)
        return nd.run_head(*args, greedy=True).tolist(), logits.argmax(dim=-1).tolist()

    with torch.inference_mode():
        row = head[7].clone()
        head.zero_()  # every logit 0 but three equal ones: ties either way
        head[7] = head[40] = head[300] = row
        tokens, ref = tokens_and_ref()
        assert tokens == ref and set(tokens) <= {0, 7}
        head[200] = float("nan")  # NaN logits from 200 on: torch's argmax picks the first NaN
        tokens, ref = tokens_and_ref()
        assert tokens == ref == [200, 200, 200]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_gives_torch_argmax(dtype, threads, one_torch_thread):
    """The sampler's native argmax of wide batches: ties (first index), a NaN (the first one), rows
    of -inf, +inf, signed zeros, widths that are not a multiple of 16 and rows of a wider tensor."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(11)
    for width in (1, 5, 16, 17, 49, 1000, 4099):
        x = torch.randn(40, width + 7, generator=g).to(dtype)[:, 3:3 + width]  # strided rows
        x[1] = 0.0
        x[2] = float("-inf")
        if width > 4:
            x[3, 4] = float("nan")
            x[3, width - 1] = float("nan")
            x[4, width // 2] = float("inf")
            x[5] = torch.round(x[5])  # many ties
            x[6] = -0.0
            x[6, width - 1] = 0.0
            x[7, -2:] = x[7].max() + 1  # a tie in the last block
        got = argmax_rows(x)
        assert got is not None and got.dtype == torch.int64
        assert torch.equal(got, x.argmax(dim=-1)), width
    assert argmax_rows(torch.zeros(3, 8, dtype=torch.float16)) is None  # other dtypes: torch's
    assert argmax_rows(torch.zeros(0, 8)).shape == (0,)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lm_head_with_a_grammar_mask_gives_the_masked_logits_and_argmax(dtype, tiny_llama_dir, one_torch_thread):
    """Structured output on the fused head: its logits are the torch head's with the bitmask
    applied (apply_grammar_bitmask), and its argmax is theirs; a row without a mask row is left as is."""
    import random

    from pagedllm.structured_output.manager import _bit
    from pagedllm.worker.sample import apply_grammar_bitmask

    _needs_bf16(dtype)
    llm, runner = _runner(tiny_llama_dir, dtype)
    nd = runner.native_decode
    rng = random.Random(5)
    batch = _decode_batch(runner, [9, 31, 55], seed=4)
    sample = [2, 0, 1]
    words = (nd.vocab + 31) // 32
    mask = torch.zeros(2, words, dtype=torch.int32)
    for r in range(2):
        for t in rng.sample(range(nd.vocab), nd.vocab // 5):
            mask[r, t // 32] |= _bit(t % 32)
    mask[1, :words // 2] = -1  # whole words allowed, as in an open JSON string
    mask_rows = np.asarray([1, -1, 0], dtype=np.int64)
    start = [kv.clone() for kv in runner.kv_caches]
    args = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)
    with torch.inference_mode():
        ref = runner.model.compute_logits(nd.run(*args)[torch.tensor(sample)]).float()
    apply_grammar_bitmask(ref, mask, [0, 2], [1, 0])
    out = []
    for greedy in (False, True):
        for kv, s in zip(runner.kv_caches, start):
            kv.copy_(s)
        out.append(nd.run_head(*args, np.asarray(sample), greedy=greedy, mask=mask, mask_rows=mask_rows))
    assert torch.equal(out[0], ref)
    assert out[1].tolist() == ref.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_generation_runs_the_fused_step_and_matches_the_torch_path(dtype, tiny_qwen3_dir, monkeypatch,
                                                                        one_torch_thread):
    """Qwen3's q/k norms run inside the fused step (it is bound, and every decode step goes
    through it): greedy tokens are the torch path's, logprobs too (bf16 at these few rows: bit
    for bit; float32: up to the GEMMs' order of sums)."""
    _needs_bf16(dtype)
    # No prefix caching: the second run's prompts then compute as the first run's did.
    llm = LLM(model=tiny_qwen3_dir, dtype=dtype, num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    runner = llm.llm_engine.core.executor.runner
    assert runner.native_decode is not None and runner.native_decode.model.q_norm
    calls = _head_calls(runner, monkeypatch)
    prompts = [{"prompt_token_ids": list(range(9, 9 + n))} for n in (4, 21, 37)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=2) for m in (20, 12, 16)]
    fused, plain = _generate_both(llm, runner, prompts, params)
    assert calls and set(calls) == {"logits"}
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if dtype == "bfloat16":
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
