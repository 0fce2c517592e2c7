"""The worker's adapters: every linear layer's LoRA slots (`--max-loras` of them, each padded to
`--max-lora-rank`), a CPU cache of loaded adapters in slot layout (`--max-cpu-loras`, least
recently used dropped first and read again from its folder when next needed), the adapter of each
request it holds, and once per step the rows of each adapter in the batch."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.lora.layers import LoRALinearMethod, LoRAStep, lora_kernel, slot_order
from pagedllm.lora.layout import Piece, lay_out, lora_target_layers
from pagedllm.lora.gguf_adapter import read_adapter

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

AdapterWeights = dict[str, list[Piece]]

def lora_dtype(config: LoRAConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The adapters' dtype: --lora-dtype, or the model's compute dtype for auto."""
    return model_dtype if config.lora_dtype == "auto" else _DTYPES[config.lora_dtype]


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, model_dtype: torch.dtype, device: torch.device,
                 triton: bool = False) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.dtype = lora_dtype(config, model_dtype)
        self.step = LoRAStep()
        self.layers = lora_target_layers(model)
        self.methods: dict[str, LoRALinearMethod] = {}
        for name, layer in self.layers.items():
            method = LoRALinearMethod(layer.quant_method, layer, self.step, config.max_loras, config.max_lora_rank,
                                      self.dtype)
            layer.quant_method = method
            self.methods[name] = method
        self.cpu_cache: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.req_lora: dict[str, tuple[int, str]] = {}  # req_id -> (adapter id, folder)
        self.num_loads = 0
        # The native kernel where it applies: on the CPU, model and adapters in float32 or bfloat16.
        supported = (torch.float32, torch.bfloat16)
        # The Triton kernels (lora/triton_lora.py) on a GPU, or where the Triton attention backend
        # runs (on the CPU: under Triton's interpreter, for tests); every dtype.
        self.triton = triton or device.type == "cuda"
        self.kernel = (lora_kernel() if not self.triton and device.type == "cpu" and model_dtype in supported
                       and self.dtype in supported else None)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req_id: str, lora: Sequence | None) -> None:
        """Records a request's adapter ((name, id, path) as the scheduler sends it, or None)."""
        if lora:
            self.req_lora[req_id] = (int(lora[1]), str(lora[2]))
        else:
            self.req_lora.pop(req_id, None)

    def fork(self, parent_id: str, child_id: str) -> None:
        if parent_id in self.req_lora:
            self.req_lora[child_id] = self.req_lora[parent_id]

    def remove_request(self, req_id: str) -> None:
        self.req_lora.pop(req_id, None)

    # ---- adapters -------------------------------------------------------------------------
    def _weights(self, lora_id: int, path: str) -> AdapterWeights:
        w = self.cpu_cache.get(lora_id)
        if w is not None:
            self.cpu_cache.move_to_end(lora_id)
            return w
        t0 = time.perf_counter()
        adapter = read_adapter(path, self.config.max_lora_rank, self.model.config)
        w = lay_out(adapter, self.model, self.config.max_lora_rank, self.dtype, self.layers)
        self.num_loads += 1
        logger.info("Loaded LoRA adapter %d from %s (rank %d, %d layers) in %.0f ms", lora_id, path, adapter.rank,
                    len(w), (time.perf_counter() - t0) * 1e3)
        self.cpu_cache[lora_id] = w
        while len(self.cpu_cache) > self.config.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
        return w

    def _slot(self, lora_id: int, path: str, needed: set[int]) -> int:
        """The adapter's slot, filled from the host cache or its folder first (a ValueError or
        OSError when the folder cannot be read: then no slot has changed)."""
        slot = self.slots.get(lora_id)
        if slot is not None:
            self.slots.move_to_end(lora_id)
            return slot
        weights = self._weights(lora_id, path)
        used = set(self.slots.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.slots if i not in needed), None)
            if victim is None:
                raise ValueError(f"a step holds more than max_loras={self.config.max_loras} adapters")
            slot = self.slots.pop(victim)
        for name, method in self.methods.items():
            method.set_slot(slot, weights.get(name))
        self.slots[lora_id] = slot
        return slot

    # ---- the step -------------------------------------------------------------------------
    def prepare(self, req_ids: Sequence[str], query_start_loc: np.ndarray) -> bool:
        """Groups this step's token rows by adapter slot (requests in batch order, request i's
        tokens at rows query_start_loc[i]:query_start_loc[i + 1]); True when any row has an adapter.

        An adapter whose folder cannot be read (deleted or corrupted since the front end checked
        it) fails only the requests that use it: their rows run without it this step and
        `step.failed` names them with the error, for the runner to report (finish_reason "error")."""
        rows: dict[int, list[tuple[int, int]]] = {}
        paths: dict[int, str] = {}
        users: dict[int, list[str]] = {}
        get = self.req_lora.get
        for i, rid in enumerate(req_ids):
            lora = get(rid)
            if lora is not None:
                rows.setdefault(lora[0], []).append((int(query_start_loc[i]), int(query_start_loc[i + 1])))
                paths[lora[0]] = lora[1]
                users.setdefault(lora[0], []).append(rid)
        step = self.step
        step.failed = {}
        if not rows:
            step.groups, step.slots, step.token_slots, step.order = (), None, None, None
            return False
        needed = set(rows)
        groups = []
        slots = None
        token_slots = np.full(int(query_start_loc[len(req_ids)]), -1, dtype=np.int32)
        for lora_id, spans in rows.items():
            try:
                slot = self._slot(lora_id, paths[lora_id], needed)
            except (ValueError, OSError) as e:
                logger.error("LoRA adapter %d cannot be read from %s; failing its %d request(s): %s", lora_id,
                             paths[lora_id], len(users[lora_id]), e)
                for rid in users[lora_id]:
                    step.failed[rid] = f"LoRA adapter {lora_id} cannot be read from {paths[lora_id]!r}: {e}"
                continue
            merged = _merge(spans)
            for a, b in merged:
                token_slots[a:b] = slot
            # With the native kernel every adapter row (decodes and prompt chunks alike) goes
            # through its one call per layer: on a 2-core AVX-512 host, 2048 bf16 prompt rows of 8
            # adapters in spans of 32 take 0.35-0.6x the time of torch's gather, two GEMMs and
            # index_add_ per adapter (0.5-0.7x for one adapter's 2048 rows; float32 0.35-0.45x).
            # With the Triton kernels every row goes through slot_order (below).
            if self.kernel is not None:
                if slots is None:
                    slots = np.full(int(query_start_loc[len(req_ids)]), -1, dtype=np.int32)
                for a, b in merged:
                    slots[a:b] = slot
            elif self.triton:
                continue
            elif len(merged) == 1:
                groups.append((slot, slice(*merged[0])))
            else:
                idx = np.concatenate([np.arange(a, b) for a, b in merged])
                groups.append((slot, torch.from_numpy(idx).to(self.device)))
        step.groups = tuple(groups)
        step.token_slots = token_slots
        step.slots = torch.from_numpy(slots) if slots is not None else None
        step.order = None
        if self.triton:
            order, step.order_rows = slot_order(token_slots, self.config.max_loras)
            step.order = torch.from_numpy(order).to(self.device)
        return True


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
