"""One engine per rank, started by an external launcher (torchrun): every rank runs the same
script with the same requests, so every rank's scheduler makes the same decisions; the model
runs in-process on this rank's share, and after each step the driver's sampled tokens are
broadcast through the process group so all the engines (and runners) stay in step.

    torchrun --nproc-per-node 2 script.py     # script: LLM(..., tensor_parallel_size=2,
                                              #   distributed_executor_backend="external_launcher")
"""

from __future__ import annotations

import logging
import os

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import init_parallel_context
from pagedllm.executor.messages import decode, encode, runner_output_from

logger = logging.getLogger(__name__)


class ExternalLauncherExecutor:
    def __init__(self, config: EngineConfig) -> None:
        pc, mc = config.parallel_config, config.model_config
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except KeyError:
            raise ValueError("distributed_executor_backend='external_launcher' runs under torchrun "
                             "(RANK and WORLD_SIZE are not set)") from None
        if world != pc.world_size:
            raise ValueError(f"torchrun started {world} processes, but tensor_parallel_size x "
                             f"pipeline_parallel_size = {pc.world_size}")
        from pagedllm.worker.model_runner import ModelRunner

        self.parallel = init_parallel_context(pc, rank, mc.num_layers, "env://")
        torch.manual_seed(mc.seed)
        self.runner = ModelRunner(mc, config.cache_config, config.device_config, parallel=self.parallel,
                                  lora_config=config.lora_config,
                                  speculative=config.speculative_config is not None)
        self.runner.load_model()
        self.driver_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size

    def _min(self, value: int) -> int:
        return int(self.parallel.all_reduce_min(value))

    def determine_num_blocks(self) -> int:
        return self._min(self.runner.determine_num_blocks())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def determine_num_swap_blocks(self) -> int:
        return self._min(self.runner.determine_num_swap_blocks())

    def initialize_swap_space(self, num_swap_blocks: int) -> None:
        self.runner.initialize_swap_space(num_swap_blocks)

    def measure_preemption_rates(self) -> tuple[float, float]:
        flops, copy = self.runner.measure_preemption_rates()
        data = self.parallel.broadcast_bytes(encode([flops, copy]) if self.parallel.is_driver else None,
                                             self.driver_rank)
        flops, copy = decode(data)
        return float(flops), float(copy)

    def flops_per_token(self) -> float:
        return self.runner.flops_per_token()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.runner.execute_model(so)
        data = self.parallel.broadcast_bytes(encode(out) if self.parallel.is_driver else None, self.driver_rank)
        if self.parallel.is_driver:
            return out
        out = runner_output_from(decode(data))
        self.runner.record_sampled(out)
        return out

    def shutdown(self) -> None:
        self.parallel.close()
