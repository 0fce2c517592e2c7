"""Checkpoint tensors into a model's parameters: the one rule every family's `load_weights` uses."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def load_tensor(params: dict[str, torch.nn.Parameter], name: str, shard: object, ckpt_name: str,
                tensor: torch.Tensor, model: str) -> None:
    """Copies the checkpoint tensor `ckpt_name` into parameter `name` (through the parameter's
    `weight_loader` with `shard` where it has one: fused, split or quantized layers); ValueError
    naming the tensor where no parameter matches or the shapes differ."""
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter in {model}")
    tensor = tensor.to(param.dtype)
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        try:
            loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None
    elif tensor.shape != param.shape:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    else:
        param.data.copy_(tensor)


def check_complete(params: Iterable[str], loaded: set[str]) -> None:
    """ValueError naming the parameters no checkpoint tensor filled."""
    missing = sorted(n for n in params if n not in loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors for {missing[:6]} ({len(missing)} in all)")


def fused_name(name: str, stacked_params: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """(parameter name, shard id) of checkpoint tensor `name`: the first fragment of
    `stacked_params` (checkpoint fragment -> (fused fragment, shard id)) it holds replaced."""
    for frag, (fused, shard_id) in stacked_params.items():
        if frag in name:
            return name.replace(frag, fused), shard_id
    return name, None


def _on_other_stage(name: str, parallel: Any, start_layer: int, end_layer: int) -> bool:
    """True for checkpoint tensors (names without `model.`) that another pipeline stage holds."""
    if name.startswith("layers."):
        return not start_layer <= int(name.split(".")[1]) < end_layer
    if name.startswith("embed_tokens."):
        return not parallel.is_first_stage
    if name.startswith(("norm.", "lm_head.")):
        return not parallel.is_last_stage
    return False


def load_decoder_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         param_name: Callable[[str], str],
                         map_param: Callable[[str], tuple[str, object]]) -> set[str]:
    """Copies a decoder's checkpoint tensors (Hugging Face names) into the parameters of its
    pipeline stage (`model.parallel`, layers `model.start_layer` to `model.end_layer`); returns the
    names loaded. `param_name` turns a checkpoint name into one without `model.`, `map_param` that
    into (parameter name, shard id). With tied embeddings the checkpoint's `lm_head.weight` is
    skipped, and a last stage without the embedding loads the embedding as its own LM head."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    tied = getattr(model.config, "tie_word_embeddings", False)
    p = model.parallel
    for ckpt_name, tensor in weights:
        if tied and ckpt_name == "lm_head.weight":
            continue
        name = param_name(ckpt_name)
        if tied and name == "embed_tokens.weight" and p.is_last_stage and not p.is_first_stage:
            name = "lm_head.weight"  # a tied LM head on a stage without the embedding loads its own copy
        elif _on_other_stage(name, p, model.start_layer, model.end_layer):
            continue
        name, shard = map_param(name)
        load_tensor(params, name, shard, ckpt_name, tensor, type(model).__name__)
        loaded.add(name)
    if tied and p.is_first_stage and p.is_last_stage:
        loaded.add("lm_head.weight")
    check_complete(params, loaded)
    return loaded
