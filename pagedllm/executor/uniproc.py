"""Runs the model runner in the engine's own process."""

from __future__ import annotations

import logging

import torch

from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class InProcessExecutor:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        torch.manual_seed(model_config.seed)
        self.runner = ModelRunner(model_config, cache_config)
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(so)
