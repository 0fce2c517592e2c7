"""Mixture-of-experts layers (Qwen3-MoE, Mixtral) in the fused native decode step against the torch
path of the same model runner.

Tiny random checkpoints that transformers builds: Qwen3-MoE with 6 experts, top 2 renormalised, one
dense layer among three (mlp_only_layers); Mixtral with 4 experts, top 2, float32 routing weights.
The step routes as layers/moe.py's route() (float32 softmax, the k largest with the lower expert
first on ties, renormalised) and runs each expert's GEMMs on the rows routed to it with the same
small-M kernel and rounding points. Tolerances: bf16 bit for bit up to small_m_rows (ties of
routing probabilities included: bf16 router logits tie often at these sizes); float32 the GEMMs'
and the softmax's last bits, measured up to 6e-6 absolute at 64 rows, asserted within rtol 1e-4,
atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.layers.moe import route
from pagedllm.layers.native_linear import small_m_rows
from pagedllm.models.testing import build_tiny_tokenizer
from pagedllm.worker.native_decode import load_decode_kernel
from tests.unit.test_native_decode import _both_paths, _decode_batch, _runner, assert_team_gives_one_thread_bits

pytestmark = pytest.mark.skipif(
    load_decode_kernel() is None or not load_decode_kernel().small_m_available() & 2,
    reason="no C compiler, or no float32 and bf16 GEMM kernels on this CPU")

_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               initializer_range=0.2)


def _save(folder, family: str) -> str:
    import transformers as t

    tok = build_tiny_tokenizer(320)
    if family == "qwen3_moe":
        config = t.Qwen3MoeConfig(**_COMMON, vocab_size=len(tok), num_hidden_layers=3, intermediate_size=96,
                                  moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                  decoder_sparse_step=1, mlp_only_layers=[1], head_dim=32)
        cls = t.Qwen3MoeForCausalLM
    else:
        config = t.MixtralConfig(**_COMMON, vocab_size=len(tok), num_hidden_layers=2, intermediate_size=64,
                                 num_local_experts=4, num_experts_per_tok=2)
        cls = t.MixtralForCausalLM
    torch.manual_seed(0)
    cls(config).float().eval().save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {f: _save(tmp_path_factory.mktemp(f), f) for f in ("qwen3_moe", "mixtral")}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_step_matches_the_torch_path(family, dtype, moe_dirs, one_torch_thread):
    llm, runner = _runner(moe_dirs[family], dtype)
    nd = runner.native_decode
    assert nd is not None and nd.moe
    for rows in (1, 3, 17, 64):
        batch = _decode_batch(runner, [5 + 29 * i % 90 for i in range(rows)], seed=rows)
        (ref, ref_kv), (out, out_kv) = _both_paths(runner, batch)
        assert out is not None and out.shape == ref.shape
        if dtype == "bfloat16" and rows <= small_m_rows(runner.dtype):
            assert torch.equal(out, ref), rows
            assert all(torch.equal(a, b) for a, b in zip(out_kv, ref_kv))
        else:
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_step_in_a_team_of_threads_gives_the_one_thread_bits(dtype, moe_dirs, one_torch_thread):
    """Each thread routes every row for itself and computes its share of every expert's GEMM rows:
    the hidden states, the logits and the argmax are the one-thread step's."""
    llm, runner = _runner(moe_dirs["qwen3_moe"], dtype)
    for rows in (1, 5, 40):
        assert_team_gives_one_thread_bits(runner, _decode_batch(runner, [4 + 37 * i % 80 for i in range(rows)],
                                                                seed=50 + rows))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_generation_through_the_fused_step_is_the_torch_paths(family, moe_dirs, monkeypatch, one_torch_thread):
    """bf16 greedy generation (decode steps through the step on to the LM head) against the same
    engine with the fused step off: the same tokens and logprobs."""
    prompts = [{"prompt_token_ids": list(range(7 + n, 7 + 2 * n))} for n in (3, 17, 40)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_NATIVE_DECODE", on)
        load_decode_kernel.cache_clear()
        llm, runner = _runner(moe_dirs[family], "bfloat16")
        assert (runner.native_decode is not None) == (on == "1")
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
    load_decode_kernel.cache_clear()
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_routing_takes_the_lower_expert_on_tied_probabilities():
    """torch.topk leaves ties to its selection algorithm (here it takes experts 3 and 5 of four tied
    ones); route() takes the larger first and, among equals, the lower expert, as the fused step."""
    logits = torch.tensor([[0.3, 0.1, 0.3, 0.3, 0.0, 0.3], [0.5, 0.2, 0.2, 0.1, 0.2, 0.0]])
    weights, ids = route(logits, 2, renormalize=True, weights_dtype=torch.float32)
    assert ids.tolist() == [[0, 2], [0, 1]]
    assert torch.allclose(weights[0], torch.tensor([0.5, 0.5]))
