"""AWQ and GPTQ folders (packed by auto-round) load and stay 4-bit; they decode like the float
model with the same effective weights; a malformed one fails with one error naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import ModelLoadError
from pagedllm.models.testing import make_tiny_checkpoint

pytest.importorskip("auto_round_extension.torch.qlinear_torch_zp")
GROUP = 32
PROMPTS = ["Hello world", "This is a tiny", "tokenizer for engine tests"]


def _rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = w.reshape(w.shape[0], -1, GROUP)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo).clamp(min=1e-6) / 15).half().float()
    return scale, torch.round(-lo / scale).clamp(1, 15)


def _pack(method: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """auto-round's packed tensors of one linear weight, and the float weight they stand for."""
    scale, zp = _rtn(w)
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data.copy_(w)
    s = scale.repeat_interleave(GROUP, 1)
    z = zp.repeat_interleave(GROUP, 1)
    ref = (torch.round(w / s + z).clamp(0, 15) - z) * s
    if method == "gptq":
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

        q = QuantLinear(4, GROUP, w.shape[1], w.shape[0], False, g_idx=True)
        q.pack(linear, scale, zp, None, "cpu")
        return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales, "g_idx": q.g_idx}, ref
    from auto_round.export.export_to_awq.utils import WQLinear_GEMM

    q = WQLinear_GEMM.from_linear(linear, 4, GROUP, scales=scale.t().contiguous(), zeros=zp.t().contiguous(),
                                  device="cpu")
    return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales}, ref


def _quantized_pair(tmp: Path, method: str) -> tuple[str, str]:
    """(quantized folder, float folder with the same effective weights)."""
    src = make_tiny_checkpoint(str(tmp / "src"), arch="llama", seed=1)
    weights = load_file(str(Path(src) / "model.safetensors"))
    quant, ref = {}, {}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            packed, deq = _pack(method, w)
            module = name.removesuffix(".weight")
            quant.update({f"{module}.{k}": v for k, v in packed.items()})
            ref[name] = deq
        else:
            quant[name] = ref[name] = w
    config = json.loads((Path(src) / "config.json").read_text())
    out = {}
    for label, tensors, qc in (("q", quant, {"quant_method": method, "bits": 4, "group_size": GROUP,
                                             "desc_act": False, "sym": False, "version": "gemm"}),
                               ("ref", ref, None)):
        folder = tmp / label
        folder.mkdir()
        for f in Path(src).iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (folder / f.name).write_bytes(f.read_bytes())
        cfg = dict(config, quantization_config=qc) if qc else config
        (folder / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        out[label] = str(folder)
    return out["q"], out["ref"]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_prequantized_folder_decodes_like_its_float_weights(tmp_path: Path, method: str, one_torch_thread) -> None:
    qdir, refdir = _quantized_pair(tmp_path, method)
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    llm = LLM(qdir, dtype="float32")  # quantization detected from config.json
    assert llm.llm_engine.model_config.quantization.method == method
    model = llm.llm_engine.executor.runner.model
    assert model.layers[0].mlp.down_proj.kernel == "int4"
    ours = llm.generate(PROMPTS, sp, use_tqdm=False)
    ref = LLM(refdir, dtype="float32").generate(PROMPTS, sp, use_tqdm=False)
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 1e-2  # the int4 kernel takes bfloat16 activations


def test_missing_scales_names_the_tensor(tmp_path: Path) -> None:
    qdir, _ = _quantized_pair(tmp_path, "gptq")
    path = Path(qdir) / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=r"lacks model\.layers\.1\.mlp\.up_proj\.scales"):
        LLM(qdir, dtype="float32")


def test_wrong_group_size_names_the_tensor(tmp_path: Path) -> None:
    qdir, _ = _quantized_pair(tmp_path, "gptq")
    cfg = json.loads((Path(qdir) / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 16
    (Path(qdir) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.\w+\.\w+_proj\.(scales|qzeros)'.*expected"):
        LLM(qdir, dtype="float32")
