"""The native LoRA kernel (native/csrc/lora.c) against the torch GEMM path of the same layer: rows
of several adapter slots and rows without one, float32 and bfloat16, a fused layer's slices, input
sizes that are not a multiple of the vector width and slices whose columns end inside a vector."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.linear import MergedLinear
from pagedllm.lora.layers import LoRALinearMethod, LoRAStep, lora_kernel
from pagedllm.lora.layout import Piece

pytestmark = pytest.mark.skipif(lora_kernel() is None, reason="no C compiler for the LoRA kernel")


def _native_and_groups(method, layer, step, x, row_slots):
    """The layer's base GEMM, then its output with the native kernel's deltas and with the torch groups'."""
    base = method.base_method.apply(layer, x, None)
    step.slots, step.groups = torch.tensor(row_slots, dtype=torch.int32), ()
    got = method.apply(layer, x, None)
    step.slots = None
    step.groups = tuple((s, torch.tensor([i for i, v in enumerate(row_slots) if v == s]))
                        for s in sorted(set(row_slots) - {-1}))
    want = method.apply(layer, x, None)
    return base, got, want


@pytest.mark.parametrize("K,N", [(64, (48, 48)), (61, (45, 43)), (13, (3, 21))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rows_equal_the_torch_groups(dtype, K, N):
    torch.manual_seed(0)
    layer = MergedLinear(K, list(N), bias=False, dtype=dtype)
    layer.weight.data.normal_()
    step = LoRAStep()
    method = LoRALinearMethod(layer.quant_method, layer, step, num_slots=3, max_rank=8, dtype=dtype)
    for slot, r in ((0, 8), (1, 3), (2, 5)):
        pieces = [Piece(0, 0, torch.randn(r, K, dtype=dtype), torch.randn(N[0], r, dtype=dtype))]
        if slot != 1:  # slot 1 leaves the up slice alone
            pieces.append(Piece(8, N[0], torch.randn(r, K, dtype=dtype), torch.randn(N[1], r, dtype=dtype)))
        method.set_slot(slot, pieces)
    x = torch.randn(11, K, dtype=dtype)
    row_slots = [0, -1, 2, 2, 1, -1, 0, 1, 1, 2, -1]
    base, got, want = _native_and_groups(method, layer, step, x, row_slots)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol if dtype == torch.float32 else 0.02)
    assert torch.equal(got[[1, 5, 10]], base[[1, 5, 10]])  # rows without an adapter are the base GEMM's
    assert not torch.allclose(got[0].float(), base[0].float())


@pytest.mark.parametrize("model_dtype,lora_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, torch.bfloat16)])
def test_blocks_of_many_rows_equal_the_torch_groups(model_dtype, lora_dtype):
    # Slots with 1 to 19 rows (blocks of up to 8 rows, and of 4 or fewer), slices of whole 32-column
    # runs and of partial ones, rows in float32 against bf16 adapters (the expand's column split).
    torch.manual_seed(1)
    K, N = 64, (96, 70)
    layer = MergedLinear(K, list(N), bias=False, dtype=model_dtype)
    layer.weight.data.normal_()
    step = LoRAStep()
    method = LoRALinearMethod(layer.quant_method, layer, step, num_slots=4, max_rank=16, dtype=lora_dtype)
    for slot in range(4):
        method.set_slot(slot, [Piece(col, start, torch.randn(16, K, dtype=lora_dtype),
                                     torch.randn(n, 16, dtype=lora_dtype)) for col, start, n in ((0, 0, N[0]),
                                                                                                  (16, N[0], N[1]))])
    row_slots = [0] * 19 + [1] * 9 + [2] * 5 + [3] + [-1] * 3
    row_slots = [row_slots[i] for i in torch.randperm(len(row_slots), generator=torch.Generator().manual_seed(2))]
    x = torch.randn(len(row_slots), K, dtype=model_dtype)
    base, got, want = _native_and_groups(method, layer, step, x, row_slots)
    exact = model_dtype == lora_dtype == torch.float32
    # bf16: the torch groups round h to bf16 and y after the add; the kernel keeps h in float32
    atol, rtol = (1e-4, 1e-4) if exact else (0.25, 0.02)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    none = [i for i, v in enumerate(row_slots) if v < 0]
    assert torch.equal(got[none], base[none])
