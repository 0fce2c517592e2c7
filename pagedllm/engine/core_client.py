"""How the front end reaches the engine core: in this process on a thread, or in its own
process over ZeroMQ. Both deliver (kind, payload) messages on the front end's event loop."""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.request import RequestStatus
from pagedllm.engine.core_io import Codec, EngineCoreOutputs, EngineCoreRequest, EngineReady, MsgKind

logger = logging.getLogger(__name__)

# (kind, payload) -> None, called on the front end's event loop.
Sink = Callable[[MsgKind, Any], None]


class EngineStartError(RuntimeError):
    """The engine core could not start (the message says why)."""


class InProcessClient:
    """The engine core on a daemon thread of this process (offline tools and tests)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.num_blocks: int = core.num_blocks
        self._commands: queue.Queue[tuple[MsgKind, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Sink) -> None:
        """Runs the core on a thread; each message is handed over to `loop` for `deliver`."""

        def handover(kind: MsgKind, payload: Any) -> None:  # on the core's thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(deliver, kind, payload)

        self._deliver = handover
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine-core", daemon=True)
        self._thread.start()

    def add_request(self, req: EngineCoreRequest) -> None:
        self._commands.put((MsgKind.ADD, req))

    def abort(self, seq_ids: list[str], stopped: bool = False) -> None:
        self._commands.put((MsgKind.STOP if stopped else MsgKind.ABORT, seq_ids))

    def watch(self, on: bool) -> None:
        """Asks the engine core for snapshots of its state (engine/snapshot.py), or stops them."""
        self._commands.put((MsgKind.WATCH, on))

    def shutdown(self) -> None:
        self._commands.put((MsgKind.SHUTDOWN, None))
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        from pagedllm.engine.snapshot import SnapshotTimer

        core = self.core
        view = SnapshotTimer()
        try:
            while True:
                busy = core.has_unfinished_requests()
                try:
                    wait = view.poll_ms(1000) / 1000
                    item = self._commands.get(timeout=wait) if not busy else self._commands.get_nowait()
                except queue.Empty:
                    item = None
                changed = False
                while item is not None:
                    kind, payload = item
                    changed = True
                    if kind == MsgKind.SHUTDOWN:
                        return
                    if kind == MsgKind.ADD:
                        core.add_request(payload)
                    elif kind == MsgKind.WATCH:
                        view.watch(payload)
                    else:
                        status = RequestStatus.FINISHED_STOPPED if kind == MsgKind.STOP else RequestStatus.FINISHED_ABORTED
                        core.abort_requests(payload, status)
                    try:
                        item = self._commands.get_nowait()
                    except queue.Empty:
                        item = None
                if core.has_unfinished_requests():
                    outputs, stats = core.step()
                    self._deliver(MsgKind.OUTPUTS, EngineCoreOutputs(outputs, stats))
                    if view.watching:
                        view.stepped(stats.step_time)
                elif changed:
                    self._deliver(MsgKind.OUTPUTS, EngineCoreOutputs([], core.stats()))
                if view.due():
                    self._deliver(MsgKind.SNAPSHOT, view.take(core))
        except BaseException as e:  # a real fault: the front end fails everyone in flight
            logger.exception("engine core failed")
            self._deliver(MsgKind.DEAD, f"{type(e).__name__}: {e}")


class MultiProcessClient:
    """The engine core in its own process (engine/core_proc.py), reached over ZeroMQ IPC sockets."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        from pagedllm.engine.core_proc import run_engine_core
        from pagedllm.executor.start_method import check_spawn_allowed

        # Spawned, so that it inherits none of the front end's event loop, sockets and threads: a main
        # script that starts the engine outside `if __name__ == "__main__":` is refused here, in one line.
        check_spawn_allowed("the engine core process")
        self.codec = Codec()
        self._dir = tempfile.mkdtemp(prefix="pagedllm-")
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        input_addr = f"ipc://{self._dir}/input"
        self.input.bind(input_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        output_addr = f"ipc://{self._dir}/output"
        self.output.bind(output_addr)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(
            target=run_engine_core,
            args=(config, input_addr, output_addr, log_level, os.getpid()),
            name="pagedllm-engine-core",
            # Not daemonic: the engine core starts tensor/pipeline-parallel worker processes of its
            # own. It dies with this process (see core_proc) and shutdown() always reaps it.
            daemon=False,
        )
        self.proc.start()
        # The engine core is not daemonic, and multiprocessing joins such children at exit: a program
        # that ends without shutdown() (an exception, say) stops the engine core first, not hangs.
        atexit.register(self.shutdown)
        self.num_blocks = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fds: list[int] = []
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def wait_ready(self, timeout: float = 1800.0) -> EngineReady:
        """Blocks until the engine core has loaded the model; raises EngineStartError if it fails."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.output.poll(200):
                kind, payload = self.codec.decode(self.output.recv())
                if kind == MsgKind.READY:
                    self.num_blocks = payload.num_blocks
                    logger.info("Engine core process %d ready", payload.pid)
                    return payload
                if kind == MsgKind.DEAD:
                    self.shutdown()
                    raise EngineStartError(payload)
            if not self.proc.is_alive():
                code = self.proc.exitcode
                self.shutdown()
                raise EngineStartError(f"the engine core process exited with code {code} while starting")
        self.shutdown()
        raise EngineStartError(f"the engine core was not ready after {timeout:.0f} s")

    # Messages drained per turn of the event loop before the rest of it (HTTP writes) runs again.
    DRAIN_BATCH = 64

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Sink) -> None:
        """Reads the engine's output socket on `loop` itself: the loop wakes on the socket's file
        descriptor and `deliver` runs there, with no receiver thread handing messages over (one
        thread and one wake-up per message fewer). The process's sentinel wakes it too: an engine
        that dies without a word is reported once."""
        self._loop, self._deliver = loop, deliver
        self._fds = [self.output.getsockopt(zmq.FD), self.proc.sentinel]
        loop.add_reader(self._fds[0], self._drain)
        loop.add_reader(self._fds[1], self._on_exit)
        # The socket's descriptor is edge-triggered: messages that came before it was watched
        # raise no new edge.
        loop.call_soon(self._drain)

    def detach(self) -> None:
        """Stops delivering messages to the event loop (call it there; shutdown() may then run on
        another thread)."""
        self._stop_watching()

    def _stop_watching(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            for fd in self._fds:
                loop.remove_reader(fd)

    def _deliver_next(self) -> bool:
        """Receives and delivers one message; False when the socket holds none. The engine's
        death (its own word, or a failed socket) ends the watching."""
        try:
            raw = self.output.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if not self._stopping and self._loop is not None:
                self._stop_watching()
                self._deliver(MsgKind.DEAD, f"the engine core's output socket failed: {e}")
            return False
        kind, payload = self.codec.decode(raw)
        if kind == MsgKind.DEAD:
            self._stop_watching()
        self._deliver(kind, payload)
        return True

    def _drain(self) -> None:
        """Delivers what the output socket holds, a batch per turn of the loop."""
        for _ in range(self.DRAIN_BATCH):
            if self._loop is None or not self._deliver_next():
                return  # drained: the descriptor signals the next message
        if self._loop is not None:
            self._loop.call_soon(self._drain)  # more may be waiting, and no new edge comes for them

    def _on_exit(self) -> None:
        """The process has exited: what it sent last is delivered, then its death, once."""
        if self._loop is None or self._stopping:
            return
        self.output.poll(100)  # its last words may still be in flight on the socket
        while self._loop is not None and self._deliver_next():
            pass
        if self._loop is not None:
            self._stop_watching()
            self.proc.join(timeout=1)
            self._deliver(MsgKind.DEAD, f"the engine core process died (exit code {self.proc.exitcode})")

    def add_request(self, req: EngineCoreRequest) -> None:
        self.input.send(self.codec.encode(MsgKind.ADD, req))

    def abort(self, seq_ids: list[str], stopped: bool = False) -> None:
        self.input.send(self.codec.encode(MsgKind.STOP if stopped else MsgKind.ABORT, seq_ids))

    def watch(self, on: bool) -> None:
        """Asks the engine core for snapshots of its state (engine/snapshot.py), or stops them."""
        if not self._stopping:
            self.input.send(self.codec.encode(MsgKind.WATCH, on))

    def shutdown(self) -> None:
        """Stops the engine core: asks, then SIGTERM, then SIGKILL; never leaves it running."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        if self.proc.is_alive():
            try:
                self.input.send(self.codec.encode(MsgKind.SHUTDOWN), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=3)
        self._stop_watching()
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
