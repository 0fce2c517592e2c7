"""Host memory of the CPU engine: the KV cache and the weights on transparent huge pages
(worker/host_memory.py), and a C heap that keeps a step's temporaries mapped (utils.tune_heap)."""

from __future__ import annotations

import ast
import platform
import subprocess
import sys

import pytest
import torch
from torch import nn

from pagedllm.worker import host_memory
from pagedllm.worker.host_memory import HUGE_PAGE, anonymous_zeros, huge_pages_available, move_weights_to_huge_pages

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("huge", [False, True])
def test_anonymous_zeros_are_zero_writable_and_aligned(dtype: torch.dtype, huge: bool) -> None:
    t, buf = anonymous_zeros((2, 37, 16, 3, 64), dtype, huge=huge)
    assert t.shape == (2, 37, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert not t.view(torch.uint8).any()
    t[1, 5] = 1.5
    assert t.view(torch.uint8).count_nonzero() > 0 and float(t[1, 5, 0, 0, 0].float()) == 1.5
    if huge:
        assert t.data_ptr() % HUGE_PAGE == 0
    del t, buf


@pytest.mark.skipif(not huge_pages_available(), reason="transparent huge pages are off in this kernel")
def test_kv_pages_come_as_huge_pages() -> None:
    before = _anon_huge_kib()
    t, buf = anonymous_zeros((16 << 20,), torch.bfloat16)  # 32 MiB
    t.fill_(1.0)
    grown = _anon_huge_kib() - before
    # The kernel may fall back to 4 KiB pages when it has no free 2 MiB frame; most of it must be huge.
    assert grown >= 16 << 10, grown
    del t, buf


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Linear(48, 96, bias=True)
        self.head = nn.Linear(48, 96, bias=False)
        self.head.weight = self.embed.weight  # one Parameter in two modules
        self.norm = nn.Parameter(torch.randn(48, generator=g), requires_grad=False)
        big = torch.randn(40, 64, generator=g, dtype=torch.bfloat16)
        self.register_buffer("table", big, persistent=False)
        self.register_buffer("cols", big[:, 8:24], persistent=False)  # a strided view of the same storage
        self.register_buffer("ids", torch.arange(7, dtype=torch.int64), persistent=False)
        self.sub = nn.Module()
        self.sub.register_buffer("shared", big, persistent=False)

    @property
    def shared(self) -> torch.Tensor:
        return self.sub.shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(x * self.norm) + self.embed(x)
        return y + self.cols.float().sum() + self.table.float().mean() + self.ids.sum()


@pytest.mark.skipif(not huge_pages_available(), reason="transparent huge pages are off in this kernel")
def test_moved_weights_keep_values_sharing_views_and_outputs() -> None:
    torch.manual_seed(0)
    m = _Tied().eval()
    x = torch.randn(5, 48)
    with torch.no_grad():
        expected = m(x)
    snapshot = {n: t.clone() for n, t in list(m.named_parameters()) + list(m.named_buffers())}
    old_ptrs = {t.data_ptr() for t in snapshot.values()}
    arena = move_weights_to_huge_pages(m)
    assert arena is not None
    with torch.no_grad():
        assert torch.equal(m(x), expected)  # same bits: the same values in the same layout
    for n, t in list(m.named_parameters()) + list(m.named_buffers()):
        assert torch.equal(t, snapshot[n]), n
        assert t.data_ptr() not in old_ptrs, n
    assert isinstance(m.head.weight, nn.Parameter) and m.head.weight is m.embed.weight
    assert m.shared is m.table  # one buffer object in two modules stays one object
    # The strided view still shares the table's storage: a write through one shows in the other.
    assert m.cols.stride() == (64, 1) and m.cols.data_ptr() == m.table.data_ptr() + 8 * 2
    m.table[3, 10] = 7.0
    assert float(m.cols[3, 2]) == 7.0
    # Everything sits in the one arena, the arena starting on a huge page.
    ptrs = [t.data_ptr() for t in m.parameters()] + [t.data_ptr() for t in m.buffers()]
    lo = min(ptrs)
    assert lo % HUGE_PAGE == 0 and max(ptrs) - lo < HUGE_PAGE


def test_no_move_without_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "huge_pages_available", lambda: False)
    m = _Tied()
    ptr = m.embed.weight.data_ptr()
    assert move_weights_to_huge_pages(m) is None and m.embed.weight.data_ptr() == ptr


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_tuned_heap_keeps_step_temporaries_mapped() -> None:
    """A step's temporaries, freed at its end, are reused by the next steps without faulting their
    pages in again. 144 MiB in 24 MiB tensors, in a fresh interpreter: in the test process an
    engine core left idle by an earlier test hands its free heap back now and then (trim_heap).
    The heap grows to its working size over the first two or three steps; from then on no step
    faults in more than a few pages, where glibc's defaults keep mapping and unmapping 24 MiB
    blocks (bench_host_memory.py: most steps fault in all 36,864 pages again)."""
    code = ("from pagedllm.utils import tune_heap; from pagedllm.benchmarks.env import temporaries_faults; "
            "assert tune_heap(); print(temporaries_faults(8))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    faults = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    # The last four steps together, under one 24 MiB tensor's pages (this VM reclaims an idle page
    # now and then).
    assert sum(faults[4:]) < 6_144, faults
