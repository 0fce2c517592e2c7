"""Gemma 3 in the fused native decode step against the torch path of the same model runner.

Tiny random Gemma 3 checkpoints (transformers' Gemma3TextConfig): sliding-window layers of 8
tokens and one global layer, so the KV cache has layer groups (five window groups and one full
group, each with its own block table); a RoPE base per layer kind (linear scaling on the global
one), query_pre_attn_scalar other than the head size, norm weights drawn at random (Gemma's
`1 + w`), heads of 32. Contexts run to 90 tokens, past the window; the window groups' blocks
before it hold the null block, as the KV cache manager leaves them.

Tolerances. bf16: the GEMMs are the same small-M kernel with the same blocking, RoPE and the KV
writes the same kernels, and the step rounds where the torch path does; Gemma's norm (float32 mean
of squares, times 1 + w) and GELU-tanh are the step's scalar loops against torch's vectorized ops,
whose float32 results may differ in the last bits, but at these shapes every bf16 rounding comes
out the same: bit for bit (up to small_m_rows). float32: the GEMMs' order of sums (MKL's against
the kernel's) and those loops' last bits: measured up to 5.5e-6 absolute at 16 rows; asserted
within rtol 1e-4, atol 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from pagedllm import LLM, SamplingParams
from pagedllm.models.testing import build_tiny_tokenizer
from pagedllm.worker.input_batch import RequestState, build_batch
from pagedllm.worker.native_decode import load_decode_kernel

pytestmark = pytest.mark.skipif(
    load_decode_kernel() is None or not load_decode_kernel().small_m_available() & 1,
    reason="no C compiler, or neither AVX-512 nor AVX2 with FMA")

WINDOW = 8
BLOCK = 4


def _save_gemma3(folder, softcap: float | None) -> str:
    tok = build_tiny_tokenizer(320)
    config = Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"], vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, query_pre_attn_scalar=24,
        final_logit_softcapping=softcap, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # they start at zero, which would make every 1 + w one
                p.normal_(0.0, 0.5)
    hf.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def gemma3_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A final logit softcap (the step ends at the final norm) and none (it runs the LM head too)."""
    root = tmp_path_factory.mktemp("gemma3")
    return {"softcap": _save_gemma3(root / "softcap", 30.0), "plain": _save_gemma3(root / "plain", None)}


def _needs_bf16(dtype: str) -> None:
    if dtype == "bfloat16" and not load_decode_kernel().small_m_available() & 2:
        pytest.skip("no bf16 GEMM kernel on this CPU (AVX-512 without AVX-512 BF16)")


def _runner(model_dir: str, dtype: str):
    llm = LLM(model=model_dir, dtype=dtype, num_kv_blocks=2048, block_size=BLOCK, enable_prefix_caching=False)
    return llm, llm.llm_engine.core.executor.runner


def _decode_batch(runner, seq_lens: list[int], seed: int):
    """A decode step of len(seq_lens) requests over random context in the KV cache: G block ids per
    block of tokens (interleaved, one per KV group), the window groups' blocks wholly before the
    window the null block 0."""
    groups = runner.kv.groups
    G = groups.num_groups
    rng = np.random.default_rng(seed)
    states, next_block = [], 1
    for i, n in enumerate(seq_lens):
        nblocks = -(-n // BLOCK)
        ids = []
        for b in range(nblocks):
            for g in range(G):
                ids.append(0 if b < groups.first_kept_block(g, n - 1, BLOCK) else next_block)
                next_block += ids[-1] != 0
        tokens = rng.integers(5, 300, n).tolist()
        states.append(RequestState(f"r{i}", tokens, n - 1, ids, n - 1, SamplingParams()))
    for kv in runner.kv_caches:
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)).to(kv.dtype))
    return build_batch(states, [1] * len(states), BLOCK, None, num_kv_groups=G, **runner.batch_options)


def _both_paths(runner, batch):
    """(torch hidden, torch KV), (native hidden, native KV), each from the same starting cache."""
    start = [kv.clone() for kv in runner.kv_caches]
    with torch.inference_mode():
        ref = runner.paths.eager.forward(batch)
    ref_kv = [kv.clone() for kv in runner.kv_caches]
    for kv, s in zip(runner.kv_caches, start):
        kv.copy_(s)
    out = runner.native_decode.run(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                                   batch.seq_lens, kv_groups=batch.kv_groups)
    return (ref, ref_kv), (out, [kv.clone() for kv in runner.kv_caches])


def _assert_same(a: torch.Tensor, b: torch.Tensor, dtype: str) -> None:
    if dtype == "bfloat16":
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_step_matches_the_torch_path(dtype, gemma3_dirs, one_torch_thread):
    _needs_bf16(dtype)
    llm, runner = _runner(gemma3_dirs["softcap"], dtype)
    nd = runner.native_decode
    assert nd is not None and nd.model.gemma and nd.num_groups == 6 and not nd.has_head
    assert list(nd._windows) == [WINDOW] * 5 + [0]
    for rows in (1, 3, 4, 16):
        batch = _decode_batch(runner, [(61 + 29 * i) % 90 + 2 for i in range(rows)], seed=rows)
        assert batch.seq_lens[0] > WINDOW
        (ref, ref_kv), (out, out_kv) = _both_paths(runner, batch)
        assert out is not None and out.dtype == ref.dtype and out.shape == ref.shape
        for a, b in zip(out_kv, ref_kv):  # each layer's K (normed, rotated) and V in its group's slots
            _assert_same(a, b, dtype)
        _assert_same(out, ref, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_step_in_a_team_of_threads_gives_the_one_thread_bits(dtype, gemma3_dirs, one_torch_thread):
    """Two threads: each norms the sublayers' whole outputs for itself and adds its own columns."""
    _needs_bf16(dtype)
    llm, runner = _runner(gemma3_dirs["softcap"], dtype)
    nd = runner.native_decode
    batch = _decode_batch(runner, [5 + 29 * i % 90 for i in range(5)], seed=7)
    start = [kv.clone() for kv in runner.kv_caches]
    args = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)
    one = nd.run(*args, kv_groups=batch.kv_groups)
    for kv, s in zip(runner.kv_caches, start):
        kv.copy_(s)
    torch.set_num_threads(2)
    try:
        two = nd.run(*args, kv_groups=batch.kv_groups)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)


def test_gemma3_step_needs_every_groups_tables(gemma3_dirs, one_torch_thread):
    llm, runner = _runner(gemma3_dirs["softcap"], "float32")
    batch = _decode_batch(runner, [12], seed=1)
    with pytest.raises(ValueError, match="kv_groups=4"):
        runner.native_decode.run(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                                 batch.seq_lens, kv_groups=batch.kv_groups[:4])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_head_step_gives_the_lm_heads_logits(dtype, gemma3_dirs, one_torch_thread):
    """Without a softcap the step runs on through the tied LM head: the torch head's logits on the
    step's own hidden states (the same GEMM: bit for bit), and their argmax."""
    _needs_bf16(dtype)
    llm, runner = _runner(gemma3_dirs["plain"], dtype)
    nd = runner.native_decode
    assert nd.has_head
    batch = _decode_batch(runner, [9, 40, 77], seed=3)
    start = [kv.clone() for kv in runner.kv_caches]
    args = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)
    sample = np.asarray([2, 0])
    with torch.inference_mode():
        ref = runner.model.compute_logits(nd.run(*args, kv_groups=batch.kv_groups)[torch.from_numpy(sample)])
    for kv, s in zip(runner.kv_caches, start):
        kv.copy_(s)
    logits = nd.run_head(*args, sample, greedy=False, kv_groups=batch.kv_groups)
    for kv, s in zip(runner.kv_caches, start):
        kv.copy_(s)
    tokens = nd.run_head(*args, sample, greedy=True, kv_groups=batch.kv_groups)
    assert torch.equal(logits, ref)
    assert tokens.tolist() == ref.argmax(dim=-1).tolist()


@pytest.mark.parametrize("arch", ["softcap", "plain"])
def test_gemma3_generation_through_the_fused_step_is_the_torch_paths(arch, gemma3_dirs, monkeypatch,
                                                                     one_torch_thread):
    """Greedy generation past the window (prompts of 4 to 37 tokens, 20 more each) runs every decode
    step through the fused step and gives the torch path's tokens (bf16)."""
    _needs_bf16("bfloat16")
    llm, runner = _runner(gemma3_dirs[arch], "bfloat16")
    nd = runner.native_decode
    calls: list[bool] = []
    run = nd.run

    def spy(*args, **kwargs):
        out = run(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(nd, "run", spy)
    prompts = [{"prompt_token_ids": list(range(9, 9 + n))} for n in (4, 21, 37)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    fused = llm.generate(prompts, params, use_tqdm=False)
    runner.native_decode = None
    try:
        plain = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.native_decode = nd
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]
    if arch == "softcap":  # the decode steps ran the fused step (the head step calls run_head instead)
        assert calls and all(calls)
