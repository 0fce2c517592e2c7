"""`pagedllm.core` (and the configs it uses) must import and schedule without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CODE = textwrap.dedent(
    """
    import sys

    class BlockTorch:
        # A meta-path finder asked before all others: any torch module fails to import.
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test ({name})")
            return None

    sys.meta_path.insert(0, BlockTorch())
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the torch blocker does not work")

    import pagedllm
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.policies import make_policy
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.scheduler_output import ModelRunnerOutput
    from pagedllm.sampling_params import SamplingParams

    assert pagedllm.SamplingParams is SamplingParams  # the package's lazy export, still torch-free
    for policy in ("fcfs", "priority", "srtf", "fair"):
        make_policy(SchedulerConfig(policy=policy))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=64), KVCacheManager(16, 4))
    for i in range(3):
        sched.add_request(Request(f"r{i}", [7] * 10, SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=i))
    outputs = {}
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        done = [sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens for r in ids]
        for res in sched.update_from_output(so, ModelRunnerOutput(ids, [[5] if d else [] for d in done])):
            outputs.setdefault(res.req_id, []).extend(res.new_token_ids)
        sched.check_integrity()
    assert outputs == {f"r{i}": [5, 5, 5] for i in range(3)}, outputs
    assert sched.kv.prefix_hits > 0  # the shared prompt was served from the prefix cache
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, loaded
    print("OK")
    """
)


def test_core_imports_and_schedules_without_torch() -> None:
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.stdout.strip().endswith("OK")
