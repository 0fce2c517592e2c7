"""What the multi-rank executors share: the executor interface in terms of two primitives,
`collective_rpc` (a runner method on every rank) and `_execute` (a step on every rank, the driver's
answer back)."""

from __future__ import annotations

from typing import Any

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.messages import runner_output_from


class MultiRankExecutor:
    world_size: int
    driver_rank: int
    _prev: dict[str, Any] | None = None

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        raise NotImplementedError

    def _execute(self, msg: dict[str, Any]) -> Any:
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        return int(min(self.collective_rpc("determine_num_blocks")))  # every rank must hold them

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def determine_num_swap_blocks(self) -> int:
        return int(min(self.collective_rpc("determine_num_swap_blocks")))

    def initialize_swap_space(self, num_swap_blocks: int) -> None:
        self.collective_rpc("initialize_swap_space", num_swap_blocks)

    def measure_preemption_rates(self) -> tuple[float, float]:
        flops, copy = self.collective_rpc("measure_preemption_rates")[self.driver_rank]
        return float(flops), float(copy)

    def flops_per_token(self) -> float:
        return float(self.collective_rpc("flops_per_token")[self.driver_rank])

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Sends the step with the driver's previous tokens (for the ranks that do not sample)."""
        out = runner_output_from(self._execute({"method": "execute_model", "so": so, "prev": self._prev}))
        self._prev = {"req_ids": out.req_ids, "sampled_token_ids": out.sampled_token_ids,
                      "logprobs": {}, "prompt_logprobs": {}}
        return out
