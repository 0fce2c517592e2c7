"""What-if simulation on the real scheduler: `pagedllm simulate`.

The engine's own Scheduler, KVCacheManager and policies run unchanged; a simulated worker takes
each SchedulerOutput, returns the ModelRunnerOutput the real worker would, and advances a clock
by the step time a cost model gives (see docs/simulator.md).
"""
