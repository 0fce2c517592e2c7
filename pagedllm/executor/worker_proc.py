"""One rank's worker: join the process group, load this rank's part of the model, then run what
the engine sends. `worker_main` is the body of a worker process of the mp executor; the Ray
executor wraps the same `RankWorker` in an actor."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import init_parallel_context
from pagedllm.distributed.shm_broadcast import ShmBroadcastReader
from pagedllm.executor.messages import decode, encode, runner_output_from, scheduler_output_from

logger = logging.getLogger(__name__)

# Runner methods the engine may call on every rank (besides execute_model).
RPC_METHODS = frozenset({
    "determine_num_blocks", "initialize_kv_cache", "determine_num_swap_blocks", "initialize_swap_space",
    "measure_preemption_rates", "flops_per_token",
})


class RankWorker:
    def __init__(self, rank: int, config: EngineConfig, init_method: str) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        mc = config.model_config
        self.ctx = init_parallel_context(config.parallel_config, rank, mc.num_layers, init_method)
        torch.manual_seed(mc.seed)
        self.runner = ModelRunner(mc, config.cache_config, config.device_config, parallel=self.ctx,
                                  lora_config=config.lora_config,
                                  speculative=config.speculative_config is not None)
        self.runner.load_model()

    def handle(self, msg: dict[str, Any]) -> tuple[bool, Any]:
        """Runs one message; (whether the engine expects an answer from this rank, the answer)."""
        method = msg["method"]
        if method == "execute_model":
            if msg["prev"] is not None and not self.ctx.is_driver:
                self.runner.record_sampled(runner_output_from(msg["prev"]))
            out = self.runner.execute_model(scheduler_output_from(msg["so"]))
            return self.ctx.is_driver, out
        if method in RPC_METHODS:
            return True, getattr(self.runner, method)(*msg["args"])
        raise ValueError(f"unknown worker method {method!r}")


def worker_main(rank: int, config: EngineConfig, init_method: str, reader_args: tuple[Any, ...],
                conn: Connection, num_threads: int, parent_pid: int, log_level: int) -> None:
    # force: a forked worker has the engine's handlers; its lines go to stderr with its rank, as a spawned one's
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s", force=True)
    torch.set_num_threads(num_threads)

    def check_parent() -> None:
        if os.getppid() != parent_pid:  # the engine is gone: nothing more will come
            logger.error("engine process %d exited; rank %d stops", parent_pid, rank)
            os._exit(1)

    try:
        worker = RankWorker(rank, config, init_method)
        reader = ShmBroadcastReader(*reader_args)
        conn.send_bytes(encode({"ok": "ready"}))
        while True:
            msg = decode(reader.read(check_parent))
            if msg["method"] == "shutdown":
                os._exit(0)  # nothing to flush; leaving the process group would wait for the peers
            reply, result = worker.handle(msg)
            if reply:
                conn.send_bytes(encode({"ok": result}))
    except BaseException as e:  # report, then exit non-zero: the engine fails its requests
        try:
            conn.send_bytes(encode({"error": f"rank {rank}: {type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()}))
        except OSError:
            pass
        sys.exit(1)
