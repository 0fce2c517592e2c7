"""Checkpoint tensors into a model's parameters: the one rule every family's `load_weights` uses."""

from __future__ import annotations

from collections.abc import Iterable

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
