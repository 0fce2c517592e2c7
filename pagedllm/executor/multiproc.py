"""Runs one worker process per rank on this host, started and supervised by the engine.

Each step the engine broadcasts the SchedulerOutput (msgpack, through shared memory) together
with the tokens the driver sampled in the previous step (the ranks that do not sample append
them to their copies of the requests); the driver (tp rank 0 of the last pipeline stage)
answers with the ModelRunnerOutput through a pipe (msgpack bytes). Every wait also watches the
worker processes: one that exits ends the engine with WorkerDiedError within about a second, and
the others are stopped.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.distributed.shm_broadcast import ShmBroadcastWriter
from pagedllm.executor.base import MultiRankExecutor
from pagedllm.executor.messages import decode, encode
from pagedllm.executor.start_method import process_context
from pagedllm.executor.worker_proc import worker_main

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process ended or failed; the engine cannot go on."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(procs: list[Any], writer: ShmBroadcastWriter) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    writer.close()


def _deadline(seconds: float) -> Callable[[], None]:
    end = time.monotonic() + seconds

    def check() -> None:
        if time.monotonic() > end:
            raise TimeoutError

    return check


class MultiprocExecutor(MultiRankExecutor):
    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.driver_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        # Forked where that is safe, so that a script without an `if __name__ == "__main__":` guard works.
        ctx = process_context(f"the engine's {self.world_size} worker processes (tensor_parallel_size="
                              f"{pc.tensor_parallel_size}, pipeline_parallel_size={pc.pipeline_parallel_size})")
        self.writer = ShmBroadcastWriter(ctx, self.world_size)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, torch.get_num_threads() // self.world_size)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(self.world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=worker_main, name=f"pagedllm-rank{rank}", daemon=True,
                args=(rank, config, init_method, self.writer.reader_args(rank), send, threads, os.getpid(),
                      logging.getLogger("pagedllm").getEffectiveLevel()),
            )
            p.start()
            send.close()
            self.procs.append(p)
            self.conns.append(recv)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.writer)
        for rank in range(self.world_size):
            self._recv(rank, timeout_s=envs.PAGEDLLM_WORKER_STARTUP_TIMEOUT)
        self.writer.unlink()  # every worker has mapped it
        logger.info("%d worker processes ready (tp=%d, pp=%d), pids %s", self.world_size, pc.tensor_parallel_size,
                    pc.pipeline_parallel_size, self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- supervision ---------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        self.shutdown()
        raise WorkerDiedError(message)

    def _check_alive(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                self._fail(f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}")

    def _recv(self, rank: int, timeout_s: float | None = None) -> Any:
        conn, t0 = self.conns[rank], time.monotonic()
        sentinels = [p.sentinel for p in self.procs]
        while True:
            ready = wait([conn, *sentinels], timeout=1.0)
            if conn in ready:
                try:
                    msg = decode(conn.recv_bytes())
                except (EOFError, OSError):
                    self._check_alive()
                    self._fail(f"worker rank {rank} closed its pipe")
                if "error" in msg:
                    logger.error("worker failed:\n%s", msg.get("traceback", ""))
                    self._fail(msg["error"])
                return msg["ok"]
            if ready:
                self._check_alive()
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                self._fail(f"worker rank {rank} did not answer within {timeout_s:.0f} s")

    def _broadcast(self, msg: dict[str, Any]) -> None:
        if not self._finalizer.alive:
            raise WorkerDiedError("the worker processes have been stopped")
        self.writer.write(encode(msg), self._check_alive)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Runs a runner method on every rank; the answers in rank order."""
        self._broadcast({"method": method, "args": list(args)})
        return [self._recv(rank) for rank in range(self.world_size)]

    def _execute(self, msg: dict[str, Any]) -> Any:
        self._broadcast(msg)
        return self._recv(self.driver_rank)

    def shutdown(self) -> None:
        """Stops the workers (a no-op the second time)."""
        if self._finalizer.alive:
            try:
                if all(p.is_alive() for p in self.procs):
                    self.writer.write(encode({"method": "shutdown"}), _deadline(5.0))
                    for p in self.procs:
                        p.join(timeout=5)
            except TimeoutError:
                logger.warning("workers did not take the shutdown message; stopping them")
            finally:
                self._finalizer()
