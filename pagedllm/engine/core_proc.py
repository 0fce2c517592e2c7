"""The engine-core process: schedule -> execute -> update in a tight loop, nothing else.

It talks to the API server process over two ZeroMQ sockets (requests in, outputs out), with
MessagePack frames (engine/core_io.py). It ends when told to, when its parent dies (the kernel
sends it SIGKILL, and it checks its parent besides) and on SIGTERM; SIGINT from a terminal is the
parent's to handle. Any fault is reported to the front end as one DEAD message before exiting 1.
Before it reports ready it runs the model's step paths once on dummy data (engine/warmup.py).
Idle for a poll interval after steps, it trims the C heap (utils.trim_heap), so that its RSS is
what it holds, not what a burst of differently shaped steps left free in the allocator.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import traceback

from typing import Any

import zmq

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.core_io import Codec, EngineReady, MsgKind
from pagedllm.engine.snapshot import SnapshotTimer
from pagedllm.utils import trim_heap

logger = logging.getLogger(__name__)

# How long an idle engine waits for a request before it checks that its parent is alive.
_IDLE_POLL_MS = 500
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent exits, however it exits."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the parent check in the idle loop still ends it


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, log_level: str, parent_pid: int) -> None:
    """Entry point of the engine-core process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
        stream=sys.stderr,
    )
    if os.getppid() != parent_pid:
        return
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(output_addr)
    codec = Codec()
    code = 0
    try:
        _serve(config, inbox, outbox, codec, parent_pid)
    except SystemExit:
        pass
    except ValueError as e:  # bad configuration found while starting (e.g. a KV cache too large)
        logger.error("engine core: %s", e)
        outbox.send(codec.encode(MsgKind.DEAD, str(e)))
        code = 1
    except BaseException as e:
        logger.error("engine core failed:\n%s", traceback.format_exc())
        outbox.send(codec.encode(MsgKind.DEAD, f"{type(e).__name__}: {e}"))
        code = 1
    finally:
        inbox.close(linger=0)
        outbox.close()
        ctx.term()
    sys.exit(code)


def _serve(config: EngineConfig, inbox: zmq.Socket, outbox: zmq.Socket, codec: Codec, parent_pid: int) -> None:
    from pagedllm.engine.core import EngineCore
    from pagedllm.engine.warmup import warm_up

    core = EngineCore(config)
    warm_up(core)  # the step paths' first calls, before READY: not on the first request's path
    # Everything loaded so far (modules, the model's Python objects) lives as long as the process:
    # moved out of the collector's generations, no collection walks it again.
    gc.collect()
    gc.freeze()
    try:
        _loop(core, inbox, outbox, codec, parent_pid)
    finally:
        core.shutdown()  # worker processes of a parallel executor go with the engine core


def _loop(core: Any, inbox: zmq.Socket, outbox: zmq.Socket, codec: Codec, parent_pid: int) -> None:
    from pagedllm.engine.core_io import EngineCoreOutputs

    check = envs.PAGEDLLM_CHECK_INTEGRITY  # the scheduler's and block pool's invariants after every step
    outbox.send(codec.encode(MsgKind.READY, EngineReady(core.num_blocks, os.getpid())))
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    stepped = False  # since the heap was last trimmed
    view = SnapshotTimer()  # the engine view's snapshots: only while a viewer watches
    while True:
        busy = core.has_unfinished_requests()
        changed = False
        if not busy and not poller.poll(view.poll_ms(_IDLE_POLL_MS)):
            if view.due():
                outbox.send(codec.encode(MsgKind.SNAPSHOT, view.take(core)))
            if os.getppid() != parent_pid:
                logger.info("the API server process is gone; the engine core exits")
                return
            if stepped:  # idle for a poll interval after a burst: give its freed heap back
                trim_heap()
                stepped = False
            continue
        rejected: list[EngineCoreOutput] = []
        while True:  # every command that has arrived, then one step
            try:
                frame = inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            kind, payload = codec.decode(frame)
            changed = True
            if kind == MsgKind.ADD:
                try:
                    core.add_request(payload)
                except ValueError as e:  # validated by the front end; fail this request alone
                    logger.error("request %s rejected by the engine core: %s", payload.request_id, e)
                    rejected += [EngineCoreOutput(sid, [], finish_reason="abort") for sid in payload.seq_ids]
            elif kind == MsgKind.ABORT:
                core.abort_requests(payload)
            elif kind == MsgKind.STOP:
                core.abort_requests(payload, RequestStatus.FINISHED_STOPPED)
            elif kind == MsgKind.WATCH:
                view.watch(payload)
            elif kind == MsgKind.SHUTDOWN:
                return
        if check:
            core.scheduler.check_integrity()
        if core.has_unfinished_requests():
            outputs, stats = core.step()
            stepped = True
            wire = rejected + outputs
            outbox.send(codec.encode(MsgKind.OUTPUTS, EngineCoreOutputs(wire, stats)))
            if view.watching:
                view.stepped(stats.step_time)
        elif changed:  # aborts while idle free blocks: the front end's gauges hear of it
            outbox.send(codec.encode(MsgKind.OUTPUTS, EngineCoreOutputs(rejected, core.stats())))
        if view.due():
            outbox.send(codec.encode(MsgKind.SNAPSHOT, view.take(core)))
