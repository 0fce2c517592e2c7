"""compressed-tensors folders (written by the compressed-tensors library, llm-compressor's format)
and FP8 folders (read back by transformers) load with their codes kept; they decode like the float
model of the weights they stand for; malformed ones fail with one error naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.ct_export import act_order_pair, export_compressed
from pagedllm.models.loader import ModelLoadError
from pagedllm.models.testing import make_tiny_checkpoint
from pagedllm.quantization import native
from pagedllm.quantization.compressed import CompressedConfig, unpack_int32

ct = pytest.importorskip("compressed_tensors")
PROMPTS = ["Hello world", "This is a tiny", "tokenizer for engine tests"]
SP = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)


def _compressed_pair(tmp: Path, preset: str, group_size: int | None = None, block: list[int] | None = None,
                     ignore: tuple[str, ...] = ("lm_head",)) -> tuple[str, str]:
    """(folder written by compressed-tensors, float folder of the weights it stands for: the
    library's fake_quantize of each weight)."""
    src = make_tiny_checkpoint(str(tmp / "src"), arch="llama", seed=1)
    qdir, refdir = str(tmp / "q"), str(tmp / "ref")
    export_compressed(src, qdir, preset, group_size, block, ignore, reference=refdir)
    return qdir, refdir


def _agree(qdir: str, refdir: str, tol: float, **kw) -> LLM:
    llm = LLM(qdir, dtype="float32", **kw)
    ours = llm.generate(PROMPTS, SP, use_tqdm=False)
    ref = LLM(refdir, dtype="float32").generate(PROMPTS, SP, use_tqdm=False)
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < tol
    return llm


def _layers(llm: LLM):
    model = llm.llm_engine.executor.runner.model
    return model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_unpack_matches_the_library_packer(bits: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    values = torch.randint(lo, hi, (5, 83), generator=gen, dtype=torch.int8)  # 83: words straddle
    packed = pack_to_int32(values, bits)
    got = unpack_int32(packed, bits, 83, "t").to(torch.int16) - (1 << (bits - 1))
    assert torch.equal(got, values.to(torch.int16))


# Tolerances on the chosen token's logprob: the 4-bit / int8 kernels take bfloat16 (or int8 per 32)
# activations, e4m3 codes' scales are rounded to bfloat16 (2^-9 relative), w8a8 quantizes each
# activation row to int8. Plain W4A16 runs in the slow suite: W4A16_ASYM takes the same int4 kernel,
# and test_ignored_modules_stay_float and test_block_fp8_and_act_order decode W4A16 folders too.
@pytest.mark.parametrize("preset,group,tol", [pytest.param("W4A16", 32, 1e-2, marks=pytest.mark.slow),
                                              ("W4A16_ASYM", 32, 1e-2), ("W8A16", 32, 1e-2),
                                              ("FP8_DYNAMIC", None, 1e-2), ("FP8", None, 1e-2)])
def test_compressed_folder_decodes_like_its_float_weights(tmp_path: Path, preset: str, group: int | None, tol: float,
                                                          one_torch_thread) -> None:
    qdir, refdir = _compressed_pair(tmp_path, preset, group_size=group)
    llm = _agree(qdir, refdir, tol)
    assert llm.llm_engine.model_config.quantization.method == "compressed-tensors"
    qkv, down = _layers(llm)
    if native.load_quant_kernel() is not None:
        assert down.kernel == {"W4A16": "int4", "W4A16_ASYM": "int4", "W8A16": "int8_group"}.get(preset, "e4m3")
    assert qkv.quant_method.name == down.quant_method.name == "compressed-tensors"


def test_int8_w8a8_folder_runs_as_w8a8(tmp_path: Path, one_torch_thread) -> None:
    from pagedllm.quantization.kernels import int8_dynamic_linear

    qdir, refdir = _compressed_pair(tmp_path, "W8A8")
    llm = _agree(qdir, refdir, 5e-2)
    qkv, down = _layers(llm)
    assert down.quant_method.name == "w8a8"
    stored = load_file(str(Path(qdir) / "model.safetensors"))
    codes = stored["model.layers.0.mlp.down_proj.weight"]
    scale = stored["model.layers.0.mlp.down_proj.weight_scale"].reshape(-1)
    assert torch.equal(down.qweight, codes)
    x = torch.randn(3, codes.shape[1], generator=torch.Generator().manual_seed(0))
    assert torch.equal(down(x), int8_dynamic_linear(x, codes.t(), scale))  # the checkpoint's own codes, to the bit


def test_block_fp8_and_act_order(tmp_path: Path, one_torch_thread) -> None:
    qdir, refdir = _compressed_pair(tmp_path / "block", "FP8_BLOCK", block=[32, 32])
    _agree(qdir, refdir, 1e-2)
    qdir, refdir = _compressed_pair(tmp_path / "act", "W4A16", group_size=32)
    act_order_pair(qdir, refdir, 32)
    llm = _agree(qdir, refdir, 1e-2)
    qkv, _ = _layers(llm)
    assert qkv.perm is not None


def test_ignored_modules_stay_float(tmp_path: Path, one_torch_thread) -> None:
    qdir, refdir = _compressed_pair(tmp_path, "W4A16", group_size=32, ignore=("lm_head", "re:.*self_attn.*"))
    llm = _agree(qdir, refdir, 1e-2)
    qkv, down = _layers(llm)
    assert type(qkv.quant_method).__name__ == "UnquantizedLinearMethod"
    assert down.quant_method.name == "compressed-tensors"


def test_fp8_checkpoint_read_alike_by_transformers(tmp_path: Path, one_torch_thread) -> None:
    """vLLM's FP8 form (quant_method fp8, 32 x 32 blocks with weight_scale_inv): the float weights
    are transformers' own dequantization of the folder."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_checkpoint(str(tmp_path / "src"), arch="llama", seed=1)
    weights = load_file(str(Path(src) / "model.safetensors"))
    q = {}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            n, k = w.shape
            blocks = w.reshape(n // 32, 32, k // 32, 32)
            s = blocks.abs().amax((1, 3)) / 448
            q[name] = (blocks / s[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
            q[name + "_scale_inv"] = s
        else:
            q[name] = w
    save_file(q, str(Path(src) / "model.safetensors"))
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (Path(src) / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)  # no GPU: transformers dequantizes
    refdir = tmp_path / "ref"
    shutil.copytree(src, refdir)
    cfg.pop("quantization_config")
    (refdir / "config.json").write_text(json.dumps(cfg))
    state = {k: v.float().contiguous() for k, v in hf.state_dict().items() if not k.endswith("scale_inv")}
    assert all(not t.is_floating_point() or t.dtype == torch.float32 for t in state.values())
    save_file(state, str(refdir / "model.safetensors"))
    llm = _agree(src, str(refdir), 1e-2)
    assert llm.llm_engine.model_config.quantization.method == "fp8"
    if native.load_quant_kernel() is not None:
        assert _layers(llm)[1].kernel == "e4m3"


def test_malformed_compressed_folder_names_the_tensor(tmp_path: Path) -> None:
    qdir, _ = _compressed_pair(tmp_path, "W4A16", group_size=32)
    path = Path(qdir) / "model.safetensors"
    tensors = load_file(str(path))
    scale = tensors.pop("model.layers.1.mlp.up_proj.weight_scale")
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=r"lacks model\.layers\.1\.mlp\.up_proj\.weight_scale"):
        LLM(qdir, dtype="float32")
    tensors["model.layers.1.mlp.up_proj.weight_scale"] = scale[:, :1].contiguous()
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_scale'.*expected"):
        LLM(qdir, dtype="float32")
    with pytest.raises(ValueError, match=r"quantization='int8'.*'compressed-tensors'"):
        LLM(qdir, dtype="float32", quantization="int8")


def test_unsupported_schemes_are_refused() -> None:
    base = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    with pytest.raises(ValueError, match="nvfp4-pack-quantized"):
        CompressedConfig(dict(base, format="nvfp4-pack-quantized"))
    with pytest.raises(ValueError, match="4-bit float weights"):
        CompressedConfig(dict(base, config_groups={"g": {"targets": ["Linear"],
                                                         "weights": {"num_bits": 4, "type": "float"}}}))
    with pytest.raises(ValueError, match="sparsity_config"):
        CompressedConfig(dict(base, sparsity_config={"format": "sparse-24-bitmask"}))
    cfg = CompressedConfig(dict(base, ignore=["lm_head", "re:.*k_proj"], config_groups={
        "a": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 64}},
        "b": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"}}}))
    assert cfg.scheme("model.layers.0.mlp.up_proj").bits == 4
    assert cfg.scheme("model.layers.0.self_attn.q_proj").bits == 8
    assert cfg.scheme("model.layers.0.self_attn.k_proj") is None and cfg.scheme("lm_head") is None
