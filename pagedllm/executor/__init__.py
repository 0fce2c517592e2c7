"""Executors: run the model for the engine, in its own process or over several ranks."""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig


def create_executor(config: EngineConfig) -> Any:
    """The executor the parallel config asks for: in-process for one rank, else mp / ray /
    external_launcher."""
    pc = config.parallel_config
    if pc.distributed_executor_backend == "external_launcher":
        from pagedllm.executor.external_launcher import ExternalLauncherExecutor

        return ExternalLauncherExecutor(config)
    if pc.world_size == 1:
        from pagedllm.executor.uniproc import InProcessExecutor

        return InProcessExecutor(config.model_config, config.cache_config, config.device_config, config.lora_config,
                                 config.draft_model_config, speculative=config.speculative_config is not None)
    if pc.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from pagedllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
