"""`pagedllm bench scale`'s models: the real shapes' configs, and on tiny versions of each shape the
GGUF written for llama.cpp read back by pagedllm's own GGUF loader equal to the safetensors (exact),
the tokenizer padded as llama.cpp's converter pads it, the llama3 RoPE factors as transformers
computes them, and, where llama-cpp-python imports in the peers' environment, llama.cpp loading the
file and decoding greedily as pagedllm does on the folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.benchmarks.scale_model import SHAPES, TOKENIZER_VOCAB, build_model, llama3_rope_factors, shape_config

TINY = {"layers": 2, "hidden": 64, "vocab": TOKENIZER_VOCAB + 200}


def test_real_shapes() -> None:
    import transformers as t

    llama = shape_config("llama-3.2-1b")
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["num_attention_heads"],
            llama["num_key_value_heads"], llama["head_dim"], llama["intermediate_size"], llama["vocab_size"]) == \
        (2048, 16, 32, 8, 64, 8192, 128256)
    assert llama["tie_word_embeddings"] and llama["rope_parameters"]["rope_type"] == "llama3"
    qwen = shape_config("qwen3-0.6b")
    assert (qwen["hidden_size"], qwen["num_hidden_layers"], qwen["num_attention_heads"], qwen["num_key_value_heads"],
            qwen["head_dim"], qwen["intermediate_size"], qwen["vocab_size"]) == (1024, 28, 16, 8, 128, 3072, 151936)
    assert qwen["tie_word_embeddings"] and qwen["rope_parameters"]["rope_theta"] == 1e6
    # parameter counts of the published models (Llama-3.2-1B: 1.236e9, Qwen3-0.6B: 0.596e9 with tied embeddings)
    for cfg, params in ((llama, 1_235_814_400), (qwen, 596_049_920)):
        config = t.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
        with torch.device("meta"):
            model = t.AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == params


def test_llama3_rope_factors_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = shape_config("llama-3.2-1b")
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (cfg["rope_parameters"]["rope_theta"] ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    ours = torch.tensor(llama3_rope_factors(cfg["rope_parameters"], 64))
    torch.testing.assert_close(base / ours, scaled.float(), rtol=1e-5, atol=0)


@pytest.fixture(scope="module", params=SHAPES)
def tiny(request, tmp_path_factory) -> tuple[str, str, str]:
    cfg = shape_config(request.param, **TINY)
    folder, gguf_path = build_model(cfg, tmp_path_factory.mktemp("scale"))
    return request.param, folder, gguf_path


def test_gguf_weights_equal_the_safetensors(tiny) -> None:
    from safetensors.torch import load_file

    from pagedllm.models.loader.gguf_reader import read_gguf_header
    from pagedllm.models.loader.gguf_weights import iterate_gguf

    shape, folder, gguf_path = tiny
    header = read_gguf_header(gguf_path)
    assert header.arch == {"llama-3.2-1b": "llama", "qwen3-0.6b": "qwen3"}[shape]
    assert ("rope_freqs.weight" in header.tensors) == (shape == "llama-3.2-1b")
    expected = load_file(str(Path(folder) / "model.safetensors"))
    ours = dict(iterate_gguf(header))  # llama.cpp's Q/K permutation undone by the loader
    assert set(ours) == set(expected)  # tied: no lm_head in either
    for name, tensor in expected.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(ours[name], tensor.float()), name


def test_gguf_tokenizer_padded_to_the_vocabulary(tiny) -> None:
    import gguf

    _, _, gguf_path = tiny
    fields = gguf.GGUFReader(gguf_path).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == TINY["vocab"]
    assert tokens[TOKENIZER_VOCAB:] == [f"[PAD{i}]" for i in range(TOKENIZER_VOCAB, TINY["vocab"])]
    assert set(types[TOKENIZER_VOCAB:]) == {int(gguf.TokenType.UNUSED)}


def test_llamacpp_loads_and_decodes_like_pagedllm(tiny) -> None:
    from pagedllm.eval.llamacpp import llamacpp_greedy, llamacpp_unavailable

    why = llamacpp_unavailable()
    if why is not None:
        pytest.skip(f"llama.cpp peer unavailable: {why}")
    from pagedllm.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    _, folder, gguf_path = tiny
    prompt = [int(x) for x in torch.randint(3, TOKENIZER_VOCAB, (16,), generator=torch.Generator().manual_seed(0))]
    llm = LLM(folder, dtype="float32", max_model_len=64)
    ours = llm.generate([{"prompt_token_ids": prompt}],
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False),
                        use_tqdm=False)[0].outputs[0].token_ids
    theirs, top = llamacpp_greedy(gguf_path, [prompt], 4)[0]
    assert len(theirs) == 4
    assert all(a == b or a in t for a, b, t in zip(ours, theirs, top)), (ours, theirs, top)
