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
    base = method.base_method.apply(layer, x, None)
    step.slots = torch.tensor(row_slots, dtype=torch.int32)
    got = method.apply(layer, x, None)
    step.slots = None
    step.groups = tuple((s, torch.tensor([i for i, v in enumerate(row_slots) if v == s])) for s in range(3))
    want = method.apply(layer, x, None)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol if dtype == torch.float32 else 0.02)
    assert torch.equal(got[[1, 5, 10]], base[[1, 5, 10]])  # rows without an adapter are the base GEMM's
    assert not torch.allclose(got[0].float(), base[0].float())
