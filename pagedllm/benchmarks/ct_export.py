"""Writing a float Hugging Face folder out as a compressed-tensors checkpoint with the
compressed-tensors library itself (llm-compressor's format, the reference producer), for the
benchmarks and the loader's tests.

Scales are round-to-nearest, from each block's min/max by the library's own ``calculate_qparams``
(llm-compressor's calibration algorithms would change the values, not the format). Optionally the
float twin: every quantized weight replaced by the library's ``fake_quantize`` of it, the float
model the checkpoint stands for; :func:`act_order_pair` turns such a pair into GPTQ's act-order
form.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from pagedllm.models.loader.source import file_cache_key, publish_dir
from pagedllm.utils import cache_dir

_COPIED = ("tokenizer", "special_tokens_map", "chat_template", "generation_config")


def _qparams(w: torch.Tensor, args):  # noqa: ANN001, ANN202
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = w.shape
    if args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "group":
        grouped = w.reshape(n, -1, args.group_size)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        blocks = w.reshape(n // bn, bn, k // bk, bk)
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        raise ValueError(f"weight strategy {args.strategy!r} is not exported")
    return calculate_qparams(lo, hi, args)


def export_compressed(src: str, out: str, preset: str, group_size: int | None = None,
                      block: list[int] | None = None, ignore: tuple[str, ...] = ("lm_head",),
                      reference: str | None = None) -> str:
    """Write ``src`` (a float Hugging Face folder) quantized with the library's ``preset``
    (W4A16, W4A16_ASYM, W8A16, W8A8, FP8, FP8_DYNAMIC, FP8_BLOCK, ...) into ``out``; with
    ``reference``, its float twin there too. ``group_size`` / ``block`` override the preset's."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size:
        scheme.weights.group_size = group_size
    if block:
        scheme.weights.block_structure = list(block)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)),
                              show_progress=False)
    twin = load_file(str(Path(src) / "model.safetensors")) if reference else {}
    for name, m in model.named_modules():
        s = getattr(m, "quantization_scheme", None)
        if s is None:
            continue
        w = m.weight.data
        scale, zp = _qparams(w, s.weights)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        zero = getattr(m, "weight_zero_point", None)
        if zero is not None:
            zero.data = zp.to(zero.dtype).reshape(zero.shape)
        if hasattr(m, "input_scale"):  # static activation scales: a fixed value (pagedllm drops them)
            m.input_scale.data.fill_(0.05)
        if reference:
            twin[f"{name}.weight"] = fake_quantize(w, m.weight_scale.data, zero, s.weights).contiguous()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in Path(src).iterdir():
        if f.name.startswith(_COPIED) or f.suffix == ".jinja":
            shutil.copy(f, Path(out) / f.name)
    if reference:
        shutil.copytree(src, reference, dirs_exist_ok=True)
        save_file(twin, str(Path(reference) / "model.safetensors"), metadata={"format": "pt"})
    return out


def act_order_pair(qdir: str, refdir: str, group: int) -> None:
    """Turn a 4-bit group-ordered pair (``export_compressed`` with ``reference``) into an act-order one
    (``actorder: group``, the form of GPTQ exports the library no longer writes): each layer's inputs
    permuted, the stored codes (re-packed by the library's packer) and the float weights alike, and
    ``weight_g_idx`` giving each input's group."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    from pagedllm.quantization.compressed import unpack_int32

    q, ref = load_file(f"{qdir}/model.safetensors"), load_file(f"{refdir}/model.safetensors")
    gen = torch.Generator().manual_seed(0)
    perms: dict[str, torch.Tensor] = {}
    for name in [n for n in q if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        n, k = q[f"{module}.weight_shape"].tolist()
        key = module.rsplit(".", 1)[0] + (".qkv" if module.endswith(("q_proj", "k_proj", "v_proj")) else
                                          ".gate_up" if module.endswith(("gate_proj", "up_proj")) else module)
        perm = perms.setdefault(key, torch.randperm(k, generator=gen))  # one input order per fused layer
        codes = unpack_int32(q[name], 4, k, name).to(torch.int16) - 8
        q[name] = pack_to_int32(codes[:, perm].to(torch.int8).contiguous(), 4)
        q[f"{module}.weight_g_idx"] = (perm // group).to(torch.int32)
        ref[f"{module}.weight"] = ref[f"{module}.weight"][:, perm].contiguous()
    save_file(q, f"{qdir}/model.safetensors")
    save_file(ref, f"{refdir}/model.safetensors")
    cfg = json.loads(Path(qdir, "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    Path(qdir, "config.json").write_text(json.dumps(cfg))


def compressed_folder(src: str, preset: str, group_size: int | None = None, twin: bool = False) -> str:
    """``src`` exported once with ``preset`` into the cache (benchmarks), or its float twin."""
    key = file_cache_key(str(Path(src) / "model.safetensors"))
    final = cache_dir() / "compressed" / f"{Path(src).name}-{preset}-g{group_size or 0}-{key}"
    if not (final / "twin").is_dir():
        shutil.rmtree(final, ignore_errors=True)

        def build(tmp: Path) -> None:
            export_compressed(src, str(tmp), preset, group_size, reference=str(tmp / "twin"))

        publish_dir(final, build)
    return str(final / "twin") if twin else str(final)
