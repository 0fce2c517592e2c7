"""Process groups and the collectives the layers and the pipeline use: the only module family
that touches torch.distributed.

Ranks are laid out stage-major, as in vLLM: global rank = pp_rank * tp_size + tp_rank, so the
tensor-parallel group of stage s is ranks [s * tp, (s + 1) * tp) and tp rank i of stage s hands
its hidden states to tp rank i of stage s + 1.
"""

from __future__ import annotations

import datetime
import logging
import socket
import uuid
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.config import ParallelConfig
from pagedllm.distributed.shm_allreduce import ShmAllReduce

logger = logging.getLogger(__name__)



@dataclass
class TensorParallelGroup:
    """One stage's tensor-parallel ranks: all-reduce and all-gather, shared memory when local."""

    rank: int = 0
    size: int = 1
    group: object = None
    shm: ShmAllReduce | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t
        if self.shm is not None and self.shm.fits(t):
            return self.shm.all_reduce(t)
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation along `dim` of every rank's `t` (same shape on each rank), in rank order."""
        if self.size == 1:
            return t
        if self.shm is not None and self.shm.fits(t):
            return self.shm.all_gather(t.contiguous(), dim)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass
class ParallelContext:
    """Where this process sits among the ranks, and the means to talk to the others. A size-1
    context (the default) makes every collective a no-op, so one model class serves all cases."""

    rank: int = 0
    tp: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    pp_rank: int = 0
    pp_size: int = 1
    layer_range: tuple[int, int] | None = None
    """[start, end) decoder layers of this stage; None: all of them."""

    @property
    def world_size(self) -> int:
        return self.tp.size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples and returns tokens: tp rank 0 of the last stage."""
        return self.is_last_stage and self.tp.rank == 0

    def layers(self, num_layers: int) -> tuple[int, int]:
        return self.layer_range or (0, num_layers)

    # ---- pipeline hand-off ---------------------------------------------------------------
    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> list[object]:
        """Starts sending to the same tp rank of the next stage; returns the pending handles."""
        dst = self.rank + self.tp.size
        return [dist.isend(t.contiguous(), dst=dst) for t in tensors]

    def recv_from_prev_stage(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        src = self.rank - self.tp.size
        out = [torch.empty(s, dtype=dtype) for s in shapes]
        for w in [dist.irecv(t, src=src) for t in out]:
            w.wait()
        return out

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """`data` from global rank `src` to every rank (a length, then a uint8 tensor)."""
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(n, src=src)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(n), dtype=torch.uint8)
        if int(n):
            dist.broadcast(buf, src=src)
        return buf.numpy().tobytes()

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.tp.shm is not None:
            self.tp.shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _same_host(ranks_group: object, size: int) -> bool:
    """True when every rank of the group runs on this host (hostnames compared by checksum)."""
    h = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
    parts = [torch.empty_like(h) for _ in range(size)]
    dist.all_gather(parts, h, group=ranks_group)
    return all(int(p) == int(h) for p in parts)


def _make_shm(group: object, rank_in_group: int, size: int, group_root: int, max_bytes: int) -> ShmAllReduce:
    name = f"pagedllm_ar_{uuid.uuid4().hex[:16]}" if rank_in_group == 0 else ""
    buf = torch.zeros(40, dtype=torch.uint8)
    if rank_in_group == 0:
        buf[: len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
        shm = ShmAllReduce(name, 0, size, max_bytes, create=True)
    dist.broadcast(buf, src=group_root, group=group)
    if rank_in_group != 0:
        name = bytes(buf.tolist()).rstrip(b"\0").decode()
        shm = ShmAllReduce(name, rank_in_group, size, max_bytes, create=False)
    dist.barrier(group=group)
    if rank_in_group == 0:
        shm.unlink()  # every rank has it mapped: nothing is left behind if a process dies
    return shm


def init_parallel_context(
    pc: ParallelConfig,
    rank: int,
    num_layers: int,
    init_method: str = "env://",
    device: str = "cpu",
    use_shm: bool = True,
    timeout_s: float = 600.0,
) -> ParallelContext:
    """Joins the process group (gloo on CPU, NCCL on GPU) and builds this rank's context."""
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    world = tp * pp
    pp_rank, tp_rank = divmod(rank, tp)
    layer_range = pc.stage_layers(num_layers, pp_rank)
    if world == 1:
        return ParallelContext(rank=0, layer_range=layer_range)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    my_group = None
    for stage in range(pp):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
        if stage == pp_rank:
            my_group = g
    group = TensorParallelGroup(rank=tp_rank, size=tp, group=my_group)
    # Messages up to this size go through the shared-memory path when every rank of the group is on
    # this host (measured with `pagedllm bench collective`: faster than gloo at every size up to it).
    shm_max_bytes = envs.PAGEDLLM_SHM_ALLREDUCE_MAX_BYTES
    if tp > 1 and use_shm and backend == "gloo" and shm_max_bytes > 0 and _same_host(my_group, tp):
        group.shm = _make_shm(my_group, tp_rank, tp, pp_rank * tp, shm_max_bytes)
    logger.info("rank %d/%d: tp %d/%d, pp stage %d/%d, layers %s, %s%s", rank, world, tp_rank, tp, pp_rank, pp,
                layer_range, backend, " + shared-memory all-reduce" if group.shm else "")
    return ParallelContext(rank=rank, tp=group, pp_rank=pp_rank, pp_size=pp, layer_range=layer_range)
