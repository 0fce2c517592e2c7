"""Places one worker actor per rank on a Ray cluster (`ray start --head` on the first machine,
`ray start --address HEAD:6379` on the others; the engine connects through RAY_ADDRESS or starts
a local Ray). The ranks join one torch.distributed group rooted at rank 0's node; the step
messages go to every actor as msgpack bytes and the driver rank answers. An actor that dies
makes the next call fail with WorkerDiedError.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.executor.base import MultiRankExecutor
from pagedllm.executor.messages import decode, encode
from pagedllm.executor.multiproc import WorkerDiedError

logger = logging.getLogger(__name__)


class _RayRank:
    """The actor: one rank's RankWorker, fed msgpack bytes."""

    def __init__(self, num_threads: int) -> None:
        import torch

        torch.set_num_threads(num_threads)
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def start(self, rank: int, config: EngineConfig, init_method: str) -> bool:
        from pagedllm.executor.worker_proc import RankWorker

        self.worker = RankWorker(rank, config, init_method)
        return True

    def call(self, data: bytes) -> bytes | None:
        reply, result = self.worker.handle(decode(data))
        return encode(result) if reply else None


class RayExecutor(MultiRankExecutor):
    def __init__(self, config: EngineConfig) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("distributed_executor_backend='ray' needs ray (pip install ray==2.60.0)") from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.driver_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        threads = envs.PAGEDLLM_RAY_WORKER_THREADS
        self.pg = placement_group([{"CPU": 1}] * self.world_size, strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        actor = ray.remote(num_cpus=1)(_RayRank)
        self.actors = [
            actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i))
            .remote(threads)
            for i in range(self.world_size)
        ]
        host, port = self._get(self.actors[0].address.remote())
        init_method = f"tcp://{host}:{port}"
        self._get([a.start.remote(rank, config, init_method) for rank, a in enumerate(self.actors)])
        logger.info("%d Ray worker actors ready (tp=%d, pp=%d)", self.world_size, pc.tensor_parallel_size,
                    pc.pipeline_parallel_size)

    def _get(self, refs: Any) -> Any:
        try:
            return self.ray.get(refs)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.RayTaskError) as e:
            self.shutdown()
            raise WorkerDiedError(f"a Ray worker failed: {e}") from None

    def _call_all(self, msg: dict[str, Any]) -> list[Any]:
        data = encode(msg)
        answers = self._get([a.call.remote(data) for a in self.actors])
        return [decode(x) if x is not None else None for x in answers]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._call_all({"method": method, "args": list(args)})

    def _execute(self, msg: dict[str, Any]) -> Any:
        return self._call_all(msg)[self.driver_rank]

    def shutdown(self) -> None:
        for a in getattr(self, "actors", []):
            self.ray.kill(a)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
