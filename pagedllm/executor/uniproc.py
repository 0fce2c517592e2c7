"""Runs the model runner in the engine's own process."""

from __future__ import annotations

import logging

import torch

from pagedllm.config import CacheConfig, DeviceConfig, LoRAConfig, ModelConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class InProcessExecutor:
    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, device_config: DeviceConfig | None = None,
        lora_config: LoRAConfig | None = None, draft_config: ModelConfig | None = None, speculative: bool = False,
    ) -> None:
        torch.manual_seed(model_config.seed)
        self.runner = ModelRunner(model_config, cache_config, device_config, lora_config=lora_config,
                                  draft_config=draft_config, speculative=speculative)
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def determine_num_swap_blocks(self) -> int:
        return self.runner.determine_num_swap_blocks()

    def initialize_swap_space(self, num_swap_blocks: int) -> None:
        self.runner.initialize_swap_space(num_swap_blocks)

    def measure_preemption_rates(self) -> tuple[float, float]:
        return self.runner.measure_preemption_rates()

    def flops_per_token(self) -> float:
        return self.runner.flops_per_token()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(so)
