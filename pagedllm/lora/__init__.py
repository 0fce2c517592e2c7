"""LoRA adapters served on one base model: the request type (`request.py`, no torch), PEFT
adapter folders read and checked (`peft.py`), their tensors laid onto a model's linear layers
(`layout.py`), the batched LoRA linear method and its per-step row groups (`layers.py`), the
worker's slots and CPU cache of loaded adapters (`manager.py`) and the front end's check of an
adapter before any request uses it (`registry.py`). See docs/lora.md."""
