"""The front end's check of an adapter before any request runs with it: the folder read and laid
onto the model's linear layers exactly as the workers will (on a model built on torch's meta
device: the layers' shapes, no weights), so a bad adapter fails its request with a ValueError
naming the tensor and the engine never sees it. An adapter id stays bound to its folder."""

from __future__ import annotations

import threading
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.lora.layout import lay_out
from pagedllm.lora.gguf_adapter import read_adapter
from pagedllm.lora.request import LoRARequest


class LoRAChecker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._model: Any = None
        self._checked: dict[int, str] = {}  # adapter id -> the folder it was checked with
        self._lock = threading.Lock()

    def _meta_model(self) -> Any:
        if self._model is None:
            from pagedllm.distributed.parallel_state import ParallelContext
            from pagedllm.models.registry import get_model_class

            mc = self.config.model_config
            with torch.device("meta"):
                self._model = get_model_class(mc.hf_config)(mc.hf_config, dtype=torch.float32,
                                                            parallel=ParallelContext(), quant_config=None)
        return self._model

    def check(self, lora: LoRARequest) -> None:
        """Raises ValueError for an adapter the engine cannot serve; each id's folder is read once."""
        lc = self.config.lora_config
        if lc is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} requested, but LoRA is not enabled "
                             "(start the engine with --enable-lora / enable_lora=True)")
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        with self._lock:
            seen = self._checked.get(lora.lora_int_id)
            if seen is not None:
                if seen != lora.lora_path:
                    raise ValueError(f"lora_int_id {lora.lora_int_id} is already bound to {seen!r}, not "
                                     f"{lora.lora_path!r}: give each adapter its own id")
                return
            adapter = read_adapter(lora.lora_path, lc.max_lora_rank, self.config.model_config.hf_config)
            lay_out(adapter, self._meta_model(), lc.max_lora_rank, torch.float32)
            self._checked[lora.lora_int_id] = lora.lora_path
