"""Writing a float Hugging Face folder out as a compressed-tensors checkpoint with the
compressed-tensors library itself (llm-compressor's format, the reference producer), for the
benchmarks and the loader's tests.

Scales are round-to-nearest, from each block's min/max by the library's own ``calculate_qparams``
(llm-compressor's calibration algorithms would change the values, not the format). Optionally the
float twin: every quantized weight replaced by the library's ``fake_quantize`` of it, the float
model the checkpoint stands for.
"""

from __future__ import annotations

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
