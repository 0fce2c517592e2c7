"""LoRA adapters on the server: `--lora-modules`, the request's `model` naming an adapter, the
adapters in /v1/models (with their `parent`), and, where PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING is
set, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies).

An adapter is checked (read and laid onto the model's layers) before it is listed; a bad one is
a 400 naming the tensor. Unloading removes the name at once: requests already running with the
adapter finish with it, new ones naming it get 404."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from pagedllm import envs
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.lora.request import LoRARequest
from pagedllm.utils import json_or_pair

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """'name=path' or '{"name": ..., "path": ..., "base_model_name": ...}' (vLLM's forms)."""
    text = text.strip()
    d = json_or_pair(text)
    if isinstance(d, dict):
        unknown = sorted(set(d) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise ValueError(f"{text!r}: a LoRA module is {{\"name\": ..., \"path\": ..., \"base_model_name\": ...}}"
                             + (f" (unknown keys {unknown})" if unknown else ""))
        return LoRAModulePath(d["name"], d["path"], d.get("base_model_name"))
    if d is None or not all(d):
        raise ValueError(f"cannot read {text!r} as name=path")
    return LoRAModulePath(*d)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class LoRAAdapters:
    """The server's adapters by name (the engine's processor checks each once)."""

    def __init__(self, processor: Any, base_names: list[str]) -> None:
        self.processor = processor
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @classmethod
    def create(cls, async_engine: Any, base_names: list[str], modules: list[LoRAModulePath] | None) -> LoRAAdapters | None:
        """The server's adapters, starting with --lora-modules (each checked); None without --enable-lora."""
        if async_engine.config.lora_config is None:
            if modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return None
        adapters = cls(async_engine.processor, base_names)
        for m in modules or []:
            adapters.add(m.name, m.path, m.base_model_name)
        return adapters

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name else None

    def add(self, name: str, path: str, base_model_name: str | None = None, replace: bool = False) -> LoRARequest:
        """Checks and registers an adapter; ValueError on a taken name or a bad adapter."""
        if name in self.base_names:
            raise ValueError(f"LoRA adapter name {name!r} is the base model's name")
        if name in self.by_name and not replace:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        if base_model_name is not None and base_model_name not in self.base_names:
            raise ValueError(f"LoRA adapter {name!r}: base_model_name {base_model_name!r} is not served here "
                             f"(served: {self.base_names})")
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        self.processor.check_lora(lora)
        self.by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", type="not_found_error",
                              param="lora_name", code="model_not_found")
        return lora

    def cards(self, card_cls: Any, max_model_len: int) -> list[Any]:
        return [card_cls(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or self.base_names[0],
                         max_model_len=max_model_len) for lora in self.by_name.values()]


def add_lora_routes(app: FastAPI, adapters: LoRAAdapters) -> None:
    """The runtime load / unload routes, where PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING allows them."""
    if not envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING:
        return
    logger.warning("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING is set: LoRA adapters may be loaded and unloaded at run time")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        if body.lora_name in adapters.by_name and not body.load_inplace:
            raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        try:  # reads the adapter's files: off the event loop
            await asyncio.to_thread(adapters.add, body.lora_name, body.lora_path, None, body.load_inplace)
        except ValueError as e:
            raise bad_request(str(e), "lora_path") from None
        logger.info("Loaded LoRA adapter %r from %s", body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        lora = adapters.by_name.get(body.lora_name)
        if lora is not None and body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id:
            raise bad_request(f"The lora adapter '{body.lora_name}' has id {lora.lora_int_id}, not "
                              f"{body.lora_int_id}", "lora_int_id")
        adapters.remove(body.lora_name)
        logger.info("Unloaded LoRA adapter %r", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
