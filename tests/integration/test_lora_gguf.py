"""LoRA adapters in GGUF, as llama.cpp's convert_lora_to_gguf.py writes them
(tests/integration/gguf_files.py's `write_gguf_lora`): a PEFT adapter of a tiny random Llama
written as a GGUF LoRA gives exactly the PEFT adapter's tokens and logprobs in float32 (F32
tensors; F16, BF16 and Q8_0 against the PEFT adapter rounded through gguf-py's own quantizer); a
GGUF adapter is refused as a PEFT one is (rank, shape, unknown or extra tensors, a missing half)
and for another base architecture, each error naming the tensor or field; and llama.cpp itself
(llama-cpp-python in the peers' environment) running the default model's F32 GGUF with a GGUF
LoRA agrees with pagedllm on the same two files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.models.testing import make_tiny_checkpoint
from tests.integration.gguf_files import write_gguf_lora
from tests.integration.test_lora import PROMPTS, make_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("lora-gguf")
    base = make_tiny_checkpoint(str(root / "base"), arch="llama")
    config = AutoConfig.from_pretrained(base)
    peft = make_adapter(base, root / "all", 4, r=6, lora_alpha=12, target_modules="all-linear")
    llm = LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8, dtype="float32",
              kv_cache_memory="32MiB", block_size=4)
    return root, base, config, peft, llm


def _generate(llm, lora) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0),
                        lora_request=lora, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                           o.outputs[0].token_ids)]) for o in outs]


def _rounded(src: str, dst: Path, qtype: str) -> str:
    """The PEFT adapter with each tensor rounded as gguf-py stores it in `qtype` (B's rows of
    fewer than 32 columns in F16, as the GGUF writer falls back)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    out = {}
    for k, t in tensors.items():
        qt = getattr(gguf.GGMLQuantizationType, qtype)
        if qt == gguf.GGMLQuantizationType.Q8_0 and t.shape[-1] % 32:
            qt = gguf.GGMLQuantizationType.F16
        data = gguf.quants.quantize(t.float().numpy(), qt)
        out[k] = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qt), dtype=np.float32).reshape(t.shape))
    save_file(out, str(dst / "adapter_model.safetensors"))
    return str(dst)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0"])
def test_gguf_adapter_equals_peft_adapter(setup, qtype):
    root, base, config, peft, llm = setup
    gguf_path = write_gguf_lora(peft, str(root / f"all.{qtype}.gguf"), "llama", config, qtype)
    reference = peft if qtype == "F32" else _rounded(peft, root / f"all-{qtype}", qtype)
    ids = {"F32": 1, "F16": 3, "BF16": 5, "Q8_0": 7}[qtype]
    theirs = _generate(llm, LoRARequest(f"peft-{qtype}", ids, reference))
    ours = _generate(llm, LoRARequest(f"gguf-{qtype}", ids + 1, gguf_path))
    assert ours == theirs  # the same tensors in the same slots: the same bits
    assert ours != _generate(llm, None)  # and the adapter changes the tokens


@pytest.mark.parametrize("case, pattern", [
    ("rank", r"tensor 'blk\.0\.attn_q\.weight\.lora_b' has rank 16, over --max-lora-rank 8"),
    ("shape", r"tensor 'blk\.0\.ffn_up\.weight\.lora_a' has 32 input columns"),
    ("unknown", r"tensor 'output\.weight\.lora_a' adapts a module that LlamaForCausalLM has no linear layer for"),
    ("norm", r"tensor 'blk\.0\.attn_norm\.weight' is neither a \.lora_a nor a \.lora_b tensor"),
    ("missing", r"tensor 'blk\.0\.attn_q\.weight' has no \.lora_b tensor"),
    ("arch", r"general\.architecture is 'qwen2', the model's is 'llama'"),
    ("not_gguf", r"is a file but not a GGUF file"),
])
def test_bad_gguf_adapters_are_refused(setup, case, pattern):
    root, base, config, peft, llm = setup
    path, arch, extra = str(root / f"bad-{case}.gguf"), "llama", None
    src = peft
    if case == "rank":
        src = make_adapter(base, root / "rank16", 9, r=16, lora_alpha=16, target_modules=["q_proj"])
    elif case == "shape":
        src = _edited(peft, root / "shape", lambda t: {**t, _key(0, "mlp.up_proj", "A"):
                                                       t[_key(0, "mlp.up_proj", "A")][:, :32].contiguous()})
    elif case == "unknown":  # the LM head's pair, as the converter writes an adapter of lm_head
        extra = {"output.weight.lora_a": torch.randn(4, config.hidden_size).numpy(),
                 "output.weight.lora_b": torch.randn(config.vocab_size, 4).numpy()}
    elif case == "norm":
        extra = {"blk.0.attn_norm.weight": torch.ones(config.hidden_size).numpy()}
    elif case == "missing":
        src = _edited(peft, root / "missing", lambda t: {k: v for k, v in t.items()
                                                         if k != _key(0, "self_attn.q_proj", "B")})
    elif case == "arch":
        arch = "qwen2"
    if case == "not_gguf":
        Path(path).write_bytes(b"safetensors? no")
    else:
        write_gguf_lora(src, path, arch, config, extra=extra)
    with pytest.raises(ValueError, match=pattern):
        llm.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(max_tokens=2),
                     lora_request=[None, LoRARequest(case, 100 + len(case), path)], use_tqdm=False)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2  # the engine serves on


def _key(layer: int, module: str, part: str) -> str:
    return f"base_model.model.model.layers.{layer}.{module}.lora_{part}.weight"


def _edited(src: str, dst: Path, edit) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    save_file(edit(load_file(str(dst / "adapter_model.safetensors"))), str(dst / "adapter_model.safetensors"))
    return str(dst)


# llama.cpp on the same two files: the default model exported to F32 GGUF and a random rank-8
# adapter on every linear layer written as a GGUF LoRA (F32). Both engines compute in float32;
# they differ in accumulation order only, so a near-tie can still go either way and the
# continuation then differs: the test asks every prompt to match token for token or to differ first
# at a step where each engine's token is in the other's top 5 (docs/architecture.md's closeness
# rule), and at least LLAMACPP_MIN_EXACT of the prompts to match exactly. The adapter must change
# the base model's tokens on most prompts, so that a wrong layout (an unpermuted q/k B, a missed
# scale) would show.
LLAMACPP_PROMPTS = 8
LLAMACPP_TOKENS = 16
LLAMACPP_MIN_EXACT = 6


@pytest.mark.slow  # an oracle run: the default model in float32 on both engines, about 30 s
def test_gguf_adapter_agrees_with_llamacpp(tmp_path, capsys):
    from pagedllm.eval.llamacpp import llamacpp_greedy, llamacpp_unavailable

    why = llamacpp_unavailable()
    if why:
        pytest.skip(f"llama.cpp peer unavailable: {why}")
    from pagedllm.benchmarks.gguf_export import export_unquantized_gguf
    from pagedllm.benchmarks.lora import write_random_adapter
    from pagedllm.models.loader import load_hf_config, resolve_model
    from tests.integration.test_quantized_greedy import _agreement

    base = export_unquantized_gguf(resolve_model(None).path, "F32")
    config = load_hf_config(resolve_model(base))
    peft = write_random_adapter(config, tmp_path / "peft", 8, 11, b_std=0.5)
    adapter = write_gguf_lora(peft, str(tmp_path / "adapter.gguf"), "llama", config)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in (6, 11, 17, 24, 31, 40, 52, 64)]
    assert len(prompts) == LLAMACPP_PROMPTS
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory="256MiB")
    sp = SamplingParams(max_tokens=LLAMACPP_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)
    lora = LoRARequest("adapter", 1, adapter)

    def run(lora_request):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=lora_request,
                            use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [list(d) for d in o.outputs[0].logprobs]) for o in outs]

    ours, ours_base = run(lora), run(None)
    theirs = llamacpp_greedy(base, prompts, LLAMACPP_TOKENS, lora=adapter)
    exact, close = _agreement(ours, theirs)
    changed = sum(a[0] != b[0] for a, b in zip(ours, ours_base))
    with capsys.disabled():
        print(f"\nGGUF LoRA vs llama.cpp: {exact}/{len(prompts)} prompts exact over {LLAMACPP_TOKENS} tokens, "
              f"{close} within top-5; the adapter changed {changed}/{len(prompts)} prompts' tokens")
    assert changed >= len(prompts) // 2
    assert close == len(prompts)
    assert exact >= LLAMACPP_MIN_EXACT
