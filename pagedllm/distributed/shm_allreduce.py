"""All-reduce through one shared-memory segment, for ranks on the same host.

Each rank copies its tensor into its own slot, publishes a sequence number, waits until every
rank has published the same number, then sums the slots in rank order (so every rank gets the
bit-identical result). Two sets of slots alternate by the parity of the sequence number: a rank
writes round s only after it has seen every rank publish round s - 1, and a rank publishes
s - 1 only after it has finished reading round s - 2, which used the same slots. One round
therefore costs two copies and a poll of a few cache lines instead of gloo's TCP round trips.

Stores are ordered on x86 (total store order): a slot's data is visible before its flag.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from pagedllm.distributed.shm import SharedBuffer

logger = logging.getLogger(__name__)

_FLAG_STRIDE = 64  # one cache line per rank's sequence number


class PeerTimeout(RuntimeError):
    """A peer rank did not reach the collective in time (it has probably died)."""


class ShmAllReduce:
    def __init__(self, name: str, rank: int, world_size: int, max_bytes: int, create: bool,
                 timeout_s: float = 60.0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        size = world_size * _FLAG_STRIDE + 2 * world_size * max_bytes
        self.shm = SharedBuffer(name, size, create)
        self._flags = np.frombuffer(self.shm.buf, dtype=np.int64, count=world_size * _FLAG_STRIDE // 8)
        if create:
            self._flags[:] = 0
        self._flag_idx = np.arange(world_size) * (_FLAG_STRIDE // 8)
        data = torch.frombuffer(self.shm.buf, dtype=torch.uint8)[world_size * _FLAG_STRIDE :]
        # slots[parity][rank]: max_bytes each.
        self._slots = data.view(2, world_size, max_bytes)
        self._seq = 0

    def unlink(self) -> None:
        """Removes the name once every rank has attached (the mappings stay valid)."""
        self.shm.unlink()

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.max_bytes

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Publishes `t` and waits for every rank's: [world_size, numel] views of the slots."""
        self._seq += 1
        seq = self._seq
        nbytes = t.numel() * t.element_size()
        slots = self._slots[seq & 1, :, :nbytes]
        slots[self.rank].view(t.dtype).copy_(t.reshape(-1))
        self._flags[self._flag_idx[self.rank]] = seq
        self._wait(seq)
        return slots.view(t.dtype)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over the ranks (a new tensor; `t` is not modified)."""
        views = self._exchange(t)
        out = views[0].clone()
        for r in range(1, self.world_size):
            out.add_(views[r])
        return out.view(t.shape)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along `dim`, in rank order."""
        views = self._exchange(t)
        return torch.cat([views[r].view(t.shape) for r in range(self.world_size)], dim=dim)

    def _wait(self, seq: int) -> None:
        flags, idx = self._flags, self._flag_idx
        if flags[idx].min() >= seq:
            return
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while flags[idx].min() < seq:
            spins += 1
            # Ranks may outnumber cores: give the others the CPU instead of burning it.
            os.sched_yield()
            if spins % 4096 == 0 and time.monotonic() > deadline:
                raise PeerTimeout(f"rank {self.rank}: peers did not reach all-reduce round {seq} "
                                  f"within {self.timeout_s:.0f} s")

    def close(self) -> None:
        self._slots = None  # type: ignore[assignment]
        self._flags = None  # type: ignore[assignment]
        self.shm.close()
