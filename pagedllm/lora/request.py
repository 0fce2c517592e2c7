"""`LoRARequest`: which adapter a request runs with (vLLM's class and field names). No torch here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique to it on this engine, and its path: a
    folder (PEFT's `adapter_config.json` + `adapter_model.safetensors`) or a GGUF LoRA file
    (llama.cpp's format)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    long_lora_max_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path")
        if self.long_lora_max_len is not None:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: long_lora_max_len is not supported")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def to_wire(self) -> tuple[str, int, str]:
        """(name, id, path): what travels to the engine core and the workers."""
        return self.lora_name, self.lora_int_id, self.lora_path
