"""The native LoRA kernel (native/csrc/lora.c) against the torch GEMM path of the same layer: rows
of several adapter slots and rows without one, float32 and bfloat16, a fused layer's slices, input
sizes that are not a multiple of the vector width and slices whose columns end inside a vector."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.linear import MergedLinear
from pagedllm.lora.layers import LoRALinearMethod, LoRAStep, lora_amx, lora_kernel, pack_a_tiles, pack_bt_tiles
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
    # bf16: the torch groups round h to bf16 and the delta before the add; the vector form keeps h in
    # float32 (the AMX form rounds it too: test_amx_tiles_equal_the_torch_groups)
    atol, rtol = (1e-4, 1e-4) if exact else (0.25, 0.02)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    none = [i for i, v in enumerate(row_slots) if v < 0]
    assert torch.equal(got[none], base[none])


def test_tile_layouts_follow_their_definition():
    # lora_amx.h's packed A and B^T, element by element against the layout's definition.
    torch.manual_seed(3)
    a = torch.randn(40, 64)
    ap = pack_a_tiles(a).view(2, 3, 16, 16, 2)  # [K/32][ceil(n/16)][p][j][e]
    for kc, ob, p, j, e in ((0, 0, 0, 0, 0), (1, 2, 15, 7, 1), (0, 1, 3, 15, 1), (1, 0, 9, 2, 0)):
        assert ap[kc, ob, p, j, e] == a[ob * 16 + j, kc * 32 + 2 * p + e]
    assert not ap[:, 2, :, 8:].any()  # outputs 40..47: zeros
    for rank, kk in ((6, 16), (24, 32)):
        bt = torch.randn(2 * rank, 37)
        bp = pack_bt_tiles(bt, 2, rank).view(2, 3, -1, kk // 2, 16, 2)  # [slice][NB][RP/kk][p][c][e]
        for i, cb, rc, p, c, e in ((0, 0, 0, 0, 0, 0), (1, 2, 0, 1, 4, 1), (1, 1, 0, 2, 15, 0)):
            k, col = rc * kk + 2 * p + e, cb * 16 + c
            assert bp[i, cb, rc, p, c, e] == (bt[i * rank + k, col] if k < rank and col < 37 else 0)
        assert not bp[:, 2, :, :, 5:].any() and not bp[:, :, -1, (rank % kk) // 2:].any()


@pytest.mark.skipif(not lora_amx(), reason="no AMX-BF16 here (or the OS does not lend the tiles)")
@pytest.mark.parametrize("rank", [16, 8, 24])
def test_amx_tiles_equal_the_torch_groups(rank):
    # bf16 rows and adapters on AMX tiles: slots with 1 to 37 rows (blocks of 16 and shorter ones),
    # rows in place (a run of consecutive rows) and gathered (shuffled), ranks that fill a tile's
    # 16 or 32 ranks and one padded from 24 to 32, slices of whole and partial 16-column blocks.
    torch.manual_seed(4)
    dtype, K, N = torch.bfloat16, 96, (96, 70)
    layer = MergedLinear(K, list(N), bias=False, dtype=dtype)
    layer.weight.data.normal_()
    step = LoRAStep()
    method = LoRALinearMethod(layer.quant_method, layer, step, num_slots=4, max_rank=rank, dtype=dtype)
    assert method.lora_ap is not None
    for slot in range(4):
        method.set_slot(slot, [Piece(col, start, torch.randn(rank, K, dtype=dtype), torch.randn(n, rank, dtype=dtype))
                               for col, start, n in ((0, 0, N[0]), (rank, N[0], N[1]))])
    shuffled = [1] * 9 + [2] * 5 + [3] + [-1] * 3 + [0] * 19
    shuffled = [shuffled[i] for i in torch.randperm(len(shuffled), generator=torch.Generator().manual_seed(5))]
    row_slots = [0] * 18 + [-1] * 2 + shuffled  # rows 0..17: one slot's consecutive rows, read in place
    x = torch.randn(len(row_slots), K, dtype=dtype)
    base, got, want = _native_and_groups(method, layer, step, x, row_slots)
    # both round h to bf16; the torch groups sum it in another order and round the delta before the add
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.02)
    none = [i for i, v in enumerate(row_slots) if v < 0]
    assert torch.equal(got[none], base[none])
    # a row's delta is the same bits alone as among the others (whatever block, tiles and order it has)
    step.groups = ()
    for t in (0, 17, 20, len(row_slots) - 1):
        step.slots = torch.tensor([s if i == t else -1 for i, s in enumerate(row_slots)], dtype=torch.int32)
        assert torch.equal(method.apply(layer, x, None)[t], got[t])
    step.slots = None
