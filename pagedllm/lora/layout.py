"""An adapter's tensors (PEFT's or GGUF's, read into the same modules) laid onto a model's linear layers, in the layout of the layers' LoRA
slots: a slot holds A [slices * R, in] and B [out, slices * R], block-diagonal over the layer's
fused slices (q | k | v, gate | up), each slice's rank padded with zeros to R = --max-lora-rank.
An adapter is kept as its pieces (where each goes in the slot), not padded.

A checkpoint module maps onto the model as its weight would (the model's `checkpoint_tensors`
splits a fused tensor such as Phi-3's qkv_proj, `map_param` names the fused layer and slice), and
each rank keeps its tensor-parallel share: a column-parallel layer's B rows like its weight's
rows, a row-parallel layer's A columns like its weight's columns (the partial products are summed
by the layer's one all-reduce, after the base GEMM's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.linear import Linear, MergedLinear, QKVLinear
from pagedllm.lora.peft import PeftAdapter


def slice_ids(layer: Linear) -> tuple[object, ...]:
    """The shard ids of a linear layer's fused slices, in row order."""
    if isinstance(layer, QKVLinear):
        return ("q", "k", "v")
    if isinstance(layer, MergedLinear):
        return tuple(range(len(layer.out_sizes)))
    return (None,)


def lora_target_layers(model: nn.Module) -> dict[str, Linear]:
    """The linear layers an adapter may adapt: every `Linear` of the model (the LM head and the
    embedding are not among them)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def _tp(layer: Linear) -> tuple[int, int]:
    tp = getattr(layer, "tp", None)
    return (tp.rank, tp.size) if tp is not None else (0, 1)


@dataclass
class Piece:
    """One slice of a layer: A [r, in] at slot rows col:col + r, B [rows, r] at slot rows
    start:start + rows and columns col:col + r."""

    col: int
    start: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor


def lay_out(adapter: PeftAdapter, model: nn.Module, max_rank: int, dtype: torch.dtype,
            layers: dict[str, Linear] | None = None) -> dict[str, list[Piece]]:
    """layer name -> its pieces for every layer the adapter touches; a ValueError naming the
    tensor when a module is unknown to the model or a shape does not fit it."""
    layers = lora_target_layers(model) if layers is None else layers
    out: dict[str, list[Piece]] = {}
    covered: set[tuple[str, object]] = set()
    for mod in adapter.modules:
        a_name, b_name = mod.a_name, mod.b_name
        r = mod.rank
        try:
            pieces = list(model.checkpoint_tensors([(f"{mod.name}.weight", mod.lora_b)]))  # type: ignore[operator]
        except ValueError as e:
            raise ValueError(f"LoRA adapter {adapter.path!r}: tensor {b_name!r}: {e}") from None
        for ckpt_name, b in pieces:
            pname, shard = model.map_param(model._param_name(ckpt_name))  # type: ignore[operator]
            layer_name = pname.removesuffix(".weight")
            layer = layers.get(layer_name)
            if layer is None:
                raise ValueError(f"LoRA adapter {adapter.path!r}: tensor {a_name!r} adapts a module that "
                                 f"{type(model).__name__} has no linear layer for")
            slices = slice_ids(layer)
            if shard not in slices:
                raise ValueError(f"LoRA adapter {adapter.path!r}: tensor {b_name!r} maps to slice {shard!r} of "
                                 f"{layer_name}, which has slices {slices}")
            rank, size = _tp(layer)
            a = mod.lora_a
            if layer.input_parallel:
                if a.shape[1] != layer.in_features * size:
                    raise ValueError(f"LoRA adapter {adapter.path!r}: tensor {a_name!r} has {a.shape[1]} input "
                                     f"columns, the model's {layer_name} takes {layer.in_features * size} (an "
                                     "adapter of another base model?)")
                a = a.narrow(1, rank * layer.in_features, layer.in_features)
            elif a.shape[1] != layer.in_features:
                raise ValueError(f"LoRA adapter {adapter.path!r}: tensor {a_name!r} has {a.shape[1]} input columns, "
                                 f"the model's {layer_name} takes {layer.in_features} (an adapter of another base "
                                 "model?)")
            start, rows = layer.shard_offsets(shard)
            if not layer.input_parallel:
                full = rows * size // getattr(layer, "kv_replicas", 1) if shard in ("k", "v") else rows * size
                if b.shape[0] != full:
                    raise ValueError(f"LoRA adapter {adapter.path!r}: tensor {b_name!r} has {b.shape[0]} output rows "
                                     f"for {layer_name} slice {shard!r}, the model's has {full} (an adapter of "
                                     "another base model?)")
                b = layer.shard_checkpoint(None, b, shard)  # type: ignore[arg-type]
            elif b.shape[0] != rows:
                raise ValueError(f"LoRA adapter {adapter.path!r}: tensor {b_name!r} has {b.shape[0]} output rows, "
                                 f"the model's {layer_name} has {rows} (an adapter of another base model?)")
            if (layer_name, shard) in covered:
                raise ValueError(f"LoRA adapter {adapter.path!r}: tensor {b_name!r} adapts slice {shard!r} of "
                                 f"{layer_name}, which another of its tensors already adapts")
            covered.add((layer_name, shard))
            col = slices.index(shard) * max_rank
            out.setdefault(layer_name, []).append(
                Piece(col, start, a.to(dtype).contiguous(), b.to(dtype).contiguous()))
    return out
