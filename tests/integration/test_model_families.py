"""Qwen3, Qwen3-MoE, Mixtral, OLMoE, Phi-3 / Phi-4-mini, Mistral with a sliding window and Qwen2 with
use_sliding_window (a window on the layers from max_window_layers on): greedy outputs equal Hugging Face
transformers' (fp32) token for token on tiny random checkpoints that transformers itself builds,
at block sizes 8 and 16, with chunked prefill and a prefix-cache hit; MoE routing equal to the
reference's on random inputs; Qwen3 and Phi-3 GGUFs in llama.cpp's layout equal to their folders."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.testing import build_tiny_tokenizer
from tests.integration.gguf_files import finish, llama_cpp_writer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 12
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
               pad_token_id=0, bos_token_id=1, eos_token_id=2,
               initializer_range=0.2)  # sharp attention: positions (RoPE tables) change the tokens


def _configs():
    import transformers as t

    return {
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM,
                  dict(intermediate_size=96, head_dim=24)),
        "qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM,
                      dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                           num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM,
                    dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
        # One window for every layer: a single window group whose blocks before the window are freed.
        "mistral": (t.MistralConfig, t.MistralForCausalLM, dict(intermediate_size=96, sliding_window=8)),
        # use_sliding_window: the layers from max_window_layers on attend within 8 tokens (layer 1 of
        # 0, 1), the others to everything: two KV layer groups.
        "qwen2_swa": (t.Qwen2Config, t.Qwen2ForCausalLM,
                      dict(intermediate_size=96, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
        "olmoe": (t.OlmoeConfig, t.OlmoeForCausalLM,
                  dict(intermediate_size=32, num_experts=8, num_experts_per_tok=3, clip_qkv=8.0)),
        # Phi-4-mini's shape: partial rotary (0.75) and LongRoPE. The sequences here stay within
        # the original length: past it, transformers' generate drops its cache and recomputes the
        # whole sequence with the long factors (test_longrope_tables checks the long rows).
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM,
                 dict(intermediate_size=96, original_max_position_embeddings=128, rope_parameters={
                     "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                     "original_max_position_embeddings": 128,
                     "short_factor": [1.0 + 0.1 * i for i in range(6)],
                     "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
    }


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _checkpoint(family: str, folder, tokenizer):
    config_cls, model_cls, extra = _configs()[family]
    config = config_cls(**{**_COMMON, **extra, "vocab_size": len(tokenizer)})
    torch.manual_seed(0)
    hf = model_cls(config).float().eval()
    hf.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return hf


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral", "olmoe", "phi3", "mistral", "qwen2_swa"])
def test_family_matches_transformers_greedy(family, tokenizer, tmp_path):
    hf = _checkpoint(family, tmp_path, tokenizer)
    g = torch.Generator().manual_seed(1)
    vocab = len(tokenizer)
    shared = torch.randint(3, vocab, (40,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 58)]
    second = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 11)]
    refs = {tuple(p): _hf_greedy(hf, p) for p in prompts + second + [shared]}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for block_size in (8, 16):
        # A 16-token budget chunks every prompt over 16 tokens.
        # The same memory for qwen2_swa, whose blocks hold one of its two layer groups each.
        num_blocks = 256 // block_size * (2 if family == "qwen2_swa" else 1)
        llm = LLM(str(tmp_path), dtype="float32", block_size=block_size, max_num_batched_tokens=16,
                  num_kv_blocks=num_blocks, max_model_len=128, enable_prefix_caching=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts + [shared]], params, use_tqdm=False)
        # The shared prefix's blocks are cached now: these two prompts start from them.
        outs += llm.generate([{"prompt_token_ids": p} for p in second], params, use_tqdm=False)
        for p, out in zip(prompts + [shared] + second, outs):
            assert out.outputs[0].token_ids == refs[tuple(p)], (family, block_size, len(p))
        assert all(o.num_cached_tokens >= 32 for o in outs[-2:]), [o.num_cached_tokens for o in outs[-2:]]
        del llm


def test_qwen2_window_layers_change_the_reference(tokenizer, tmp_path):
    """The qwen2_swa case would not notice its window ignored: without use_sliding_window the same
    weights continue the long prompt differently; pagedllm gives the windowed layer its window and
    the other layer none, in two KV layer groups."""
    import transformers as t

    hf = _checkpoint("qwen2_swa", tmp_path, tokenizer)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    plain = t.Qwen2ForCausalLM(t.Qwen2Config(**{**hf.config.to_dict(), "use_sliding_window": False,
                                                "layer_types": None})).float().eval()
    plain.load_state_dict(hf.state_dict())
    prompt = torch.randint(3, len(tokenizer), (58,), generator=torch.Generator().manual_seed(1)).tolist()
    assert _hf_greedy(plain, prompt) != _hf_greedy(hf, prompt)
    llm = LLM(str(tmp_path), dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=128)
    layers = [m.self_attn.attn for m in llm.llm_engine.executor.runner.model.layers]
    assert [a.sliding_window for a in layers] == [0, 8]
    assert llm.llm_engine.scheduler.kv.groups.windows == (0, 8)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_moe_routing_matches_transformers(family, tokenizer, tmp_path):
    """The sparse block's output (router, top-k incl. ties' order, renormalisation, experts)
    against the reference block on random hidden states, in float32 and bfloat16."""
    from safetensors.torch import load_file

    from pagedllm.models.registry import get_model_class

    hf = _checkpoint(family, tmp_path, tokenizer)
    tensors = load_file(str(tmp_path / "model.safetensors"))  # one matrix per expert, as on the Hub
    ours = get_model_class(hf.config)(hf.config, torch.float32)
    ours.load_weights(tensors.items())
    hf_block = getattr(hf.model.layers[0], "mlp", None) or hf.model.layers[0].block_sparse_moe
    x = torch.randn(37, hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf_block(x.unsqueeze(0))[0]
        torch.testing.assert_close(ours.layers[0].mlp(x), want, rtol=1e-5, atol=1e-5)
        hf_block.to(torch.bfloat16)
        ours_bf16 = get_model_class(hf.config)(hf.config, torch.bfloat16)
        ours_bf16.load_weights(tensors.items())
        xb = x.to(torch.bfloat16)
        torch.testing.assert_close(ours_bf16.layers[0].mlp(xb), hf_block(xb.unsqueeze(0))[0], rtol=2e-2, atol=2e-2)


def test_longrope_tables_match_transformers():
    """Phi-4-mini's rotary: the rows below original_max_position_embeddings are the reference's
    short-factor ones, the rows from it on its long-factor ones (what it uses once a sequence is
    longer), both over the first 0.75 of the head."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from pagedllm.layers.partial_rotary import PartialRotaryEmbedding

    config = Phi3Config(**{**_COMMON, **_configs()["phi3"][2], "vocab_size": 320,
                           "original_max_position_embeddings": 64})
    config.rope_parameters["original_max_position_embeddings"] = 64
    ref = Phi3RotaryEmbedding(config)
    ours = PartialRotaryEmbedding(config, 16, 256, torch.float32)
    assert ours.rotary_dim == 12
    x = torch.zeros(1, 1, 16)
    short = ref(x, torch.arange(64)[None])  # max position + 1 = 64: short factors
    long = ref(x, torch.arange(64, 256)[None])  # beyond: long factors
    assert torch.equal(short[0][0], ours.cos[:64]) and torch.equal(short[1][0], ours.sin[:64])
    assert torch.equal(long[0][0], ours.cos[64:]) and torch.equal(long[1][0], ours.sin[64:])
    assert not torch.equal(ours.cos[64:], PartialRotaryEmbedding(
        Phi3Config(**{**_COMMON, **_configs()["phi3"][2], "vocab_size": 320}), 16, 256, torch.float32).cos[64:])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral", "olmoe", "phi3"])
def test_fused_native_decode_takes_qwen3_and_its_moe_and_declines_the_others(family):
    """The C decode step computes the Llama layer, Qwen3's (q/k norms) and their mixture-of-experts
    blocks (Qwen3-MoE, Mixtral); OLMoE (q/k norms over all heads, clip_qkv) and Phi-3 (partial
    rotary, LongRoPE) run the eager path."""
    from pagedllm.models.registry import get_model_class
    from pagedllm.worker.native_decode import _unsupported_reason

    config_cls, hf_cls, extra = _configs()[family]
    config = config_cls(**{**_COMMON, **extra, "vocab_size": 320})  # no `architectures`: found by model_type
    model = get_model_class(config)(config, torch.float32)
    assert type(model).__name__ == hf_cls.__name__
    reason = _unsupported_reason(model, torch.float32, torch.float32)
    assert reason is None if family in ("qwen3", "qwen3_moe", "mixtral") else reason is not None


@pytest.mark.slow
def test_qwen3_moe_tensor_parallel_matches_one_rank(tokenizer, tmp_path):
    """TP=2 splits every expert's intermediate dimension (and the dense layer's MLP, the heads):
    the same greedy tokens and logprobs within 1e-4 as one rank."""
    _checkpoint("qwen3_moe", tmp_path, tokenizer)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, len(tokenizer), (n,), generator=g).tolist()} for n in (7, 30)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = []
    for tp in (1, 2):
        llm = LLM(str(tmp_path), dtype="float32", tensor_parallel_size=tp, block_size=8, max_num_batched_tokens=16,
                  num_kv_blocks=32, max_model_len=128)
        try:
            runs.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.llm_engine.shutdown()
    for one, two in zip(*runs):
        a, b = one.outputs[0], two.outputs[0]
        assert a.token_ids == b.token_ids
        for t, la, lb in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(la[t].logprob - lb[t].logprob) <= 1e-4


def write_llama_cpp_gguf(hf, path: str, arch: str) -> None:
    """A float32 GGUF of `hf` laid out as llama.cpp's converter writes the architecture: tensor
    names from gguf-py's tables (the converter's own), fused tensors kept fused, no permutation
    (llama.cpp permutes Q/K for llama files only), its metadata keys; Phi-3's LongRoPE factors as
    the rope_factors_long / rope_factors_short tensors."""
    import math

    import gguf
    import numpy as np

    c = hf.config
    model_arch = {"qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3}[arch]
    names = gguf.get_tensor_name_map(model_arch, c.num_hidden_layers)
    rope = c.rope_parameters
    w = llama_cpp_writer(path, arch, c, rope["rope_theta"])
    if arch == "qwen3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    else:
        original = c.original_max_position_embeddings
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * c.hidden_size) // c.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(c.sliding_window or 0)
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        for key, tensor in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
                            ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):
            w.add_tensor(gguf.TENSOR_NAMES[tensor] + ".weight", np.asarray(rope[key], dtype=np.float32))
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy().astype(np.float32))
    finish(w)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_llama_cpp_gguf_matches_the_hf_folder(family, tokenizer, tmp_path):
    """The family's GGUF in llama.cpp's layout (transformers' GGUF loader reads the original weights
    back from it) generates what the Hugging Face folder generates, token for token in float32."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "hf"
    hf = _checkpoint(family, folder, tokenizer)
    write_llama_cpp_gguf(hf, str(tmp_path / "tiny.gguf"), family)
    # The shapes from the original config: transformers reads no head size from a qwen3 file.
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", config=hf.config,
                                                dtype=torch.float32)
    original = hf.state_dict()
    for name, t in back.state_dict().items():
        torch.testing.assert_close(t, original[name], atol=0, rtol=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in (5, 37, 90)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, path, kw in (("hf", str(folder), {}), ("gguf", str(tmp_path / "tiny.gguf"), {"tokenizer": str(folder)})):
        llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=32, num_kv_blocks=64,
                  max_model_len=128, **kw)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                  params, use_tqdm=False)]
        del llm
    assert outs["gguf"] == outs["hf"] == [_hf_greedy(hf, p) for p in prompts]
