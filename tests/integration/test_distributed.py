"""Tensor and pipeline parallelism against one rank: the same tokens (or a difference the
closeness rule of docs/architecture.md explains) and the same logprobs within 1e-4, under chunked prefill and
forced preemption; n > 1 with copy-on-write, swap preemption and aborts across ranks; the
divisibility error; a killed worker ends the engine; a script without the `__main__` guard forks
its workers (and, where forking is unsafe, is refused in one line that names the guard).

The default model at PP=2 and TP=3 x PP=2 (six processes) runs with `make test-distributed`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.testing import make_tiny_checkpoint
from pagedllm.quantization.native import load_quant_kernel

from test_correctness_hf import PROMPTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HEAVY = pytest.mark.skipif(not os.environ.get("PAGEDLLM_TEST_DISTRIBUTED"),
                           reason="the default model's pipeline runs (2 and 6 processes, minutes on 2 cores): "
                                  "make test-distributed")
TOP = 5
# Chunked prefill (16 tokens a step) and a cache too small for the batch: preemption is certain.
TIGHT = {"dtype": "float32", "max_num_batched_tokens": 16, "num_kv_blocks": 10, "block_size": 8,
         "max_model_len": 128}


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama with 8 query heads and 2 KV heads (TP=4 replicates each KV head twice)."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny8") / "llama"), arch="llama", seed=1,
                                num_attention_heads=8, num_key_value_heads=2)


def run(model: str | None, prompts: list[str], **kwargs) -> list[list]:
    """Greedy, then sampled outputs of one engine."""
    llm = LLM(model, **{**TIGHT, **kwargs})
    try:
        outs = [llm.generate(prompts, p, use_tqdm=False) for p in (GREEDY, SAMPLED)]
        assert llm.llm_engine.scheduler.get_stats().num_preemptions > 0
        return outs
    finally:
        llm.llm_engine.shutdown()


def assert_same(ref: list, got: list, atol: float = 1e-4) -> None:
    """Tokens equal up to a first difference that the logprob rule explains; logprobs within atol."""
    for r, g in zip(ref, got, strict=True):
        for rc, gc in zip(r.outputs, g.outputs, strict=True):
            for i, (a, b) in enumerate(zip(rc.token_ids, gc.token_ids)):
                ra, gb = rc.logprobs[i], gc.logprobs[i]
                if a != b:
                    top_r = sorted(ra, key=lambda t: ra[t].rank)[:TOP]
                    top_g = sorted(gb, key=lambda t: gb[t].rank)[:TOP]
                    assert a in top_g and b in top_r, f"position {i}: {a} (top {top_r}) vs {b} (top {top_g})"
                    break
                assert abs(ra[a].logprob - gb[b].logprob) <= atol, (i, ra[a].logprob, gb[b].logprob)
            else:
                assert len(rc.token_ids) == len(gc.token_ids)


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=TOP)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True, logprobs=TOP)


def test_divisibility_error_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"9 attention heads are not divisible by tensor_parallel_size=2"):
        EngineArgs(tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match=r"pipeline_layer_partition \[10, 10\] sums to 20, but the model has 30"):
        EngineArgs(pipeline_parallel_size=2, pipeline_layer_partition="10,10").create_engine_config()


# The tiny tokenizer spends about a token per byte: prompts of up to 170 tokens; six of them
# outgrow the 28 blocks of 8 tokens together (run() asserts the preemption).
TINY_ROOM = {"num_kv_blocks": 28, "max_model_len": 256}
TINY_PROMPTS = PROMPTS[:6]


@pytest.fixture(scope="module")
def tiny_tp1(tiny8: str) -> list[list]:
    return run(tiny8, TINY_PROMPTS, **TINY_ROOM)


@pytest.mark.parametrize("parallel", [
    pytest.param({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),  # make test: both kinds at once
    pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow),
    pytest.param({"tensor_parallel_size": 4}, marks=pytest.mark.slow),
    pytest.param({"pipeline_parallel_size": 2}, marks=pytest.mark.slow),
])
def test_tiny_llama_matches_one_rank(tiny8: str, tiny_tp1: list[list], parallel: dict) -> None:
    for ref, got in zip(tiny_tp1, run(tiny8, TINY_PROMPTS, **TINY_ROOM, **parallel)):
        assert_same(ref, got)


DEFAULT_PROMPTS = PROMPTS[:10]
FORKED = SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=3, ignore_eos=True, logprobs=TOP)
FORK_PROMPTS = PROMPTS[10:14]


@pytest.fixture(scope="module")
def default_tp1() -> dict:
    """One rank's outputs on the default model (swap preemption), for the parallel runs to match."""
    llm = LLM(**TIGHT, preemption_mode="swap")
    outs = {p.seed: llm.generate(DEFAULT_PROMPTS, p, use_tqdm=False) for p in (GREEDY, SAMPLED)}
    outs["forked"] = llm.generate(FORK_PROMPTS, FORKED, use_tqdm=False)
    assert llm.llm_engine.scheduler.get_stats().num_preemptions_by_mode["swap"] > 0
    return outs


@pytest.mark.slow
def test_default_model_tp3_matches_one_rank(default_tp1: dict) -> None:
    """Greedy and sampled, then n > 1 (copy-on-write forks), swap preemption and an abort."""
    llm = LLM(tensor_parallel_size=3, **TIGHT, preemption_mode="swap")
    try:
        for p in (GREEDY, SAMPLED):
            assert_same(default_tp1[p.seed], llm.generate(DEFAULT_PROMPTS, p, use_tqdm=False))
        ref = default_tp1["forked"]
        assert_same(ref, llm.generate(FORK_PROMPTS, FORKED, use_tqdm=False))
        assert llm.llm_engine.scheduler.get_stats().num_preemptions_by_mode["swap"] > 0
        # An abort mid-run: the other requests finish as before and every block comes back.
        e = llm.llm_engine
        for i, p in enumerate(FORK_PROMPTS):
            e.add_request(f"r{i}", p, FORKED)
        for _ in range(6):
            e.step()
        e.abort_request("r1")
        done = {}
        while e.has_unfinished_requests():
            for out in e.step():
                if out.finished:
                    done[out.request_id] = out
        assert "r1" not in done and sorted(done) == ["r0", "r2", "r3"]
        assert_same([ref[0], ref[2], ref[3]], [done["r0"], done["r2"], done["r3"]])
        assert e.scheduler.kv.num_free_blocks == e.num_blocks
    finally:
        llm.llm_engine.shutdown()


@HEAVY
@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"pipeline_parallel_size": 2},
                                      {"tensor_parallel_size": 3, "pipeline_parallel_size": 2}])
def test_default_model_pipeline_matches_one_rank(default_tp1: dict, parallel: dict) -> None:
    outs = run(None, DEFAULT_PROMPTS, preemption_mode="swap", **parallel)
    for p, got in zip((GREEDY, SAMPLED), outs):
        assert_same(default_tp1[p.seed], got)


KILL_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from pagedllm import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32")
        print("PIDS", *llm.llm_engine.executor.worker_pids, flush=True)
        sys.stdin.readline()
        llm.generate(["hello"] * 32, SamplingParams(max_tokens=480, ignore_eos=True), use_tqdm=False)
""")


@pytest.mark.slow
def test_killed_worker_ends_the_engine(tiny8: str, tmp_path) -> None:
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), tiny8], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read()
        pids = [int(x) for x in line.split()[1:]]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(0.5)  # generating
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
        assert time.monotonic() - t0 < 10
        assert proc.returncode != 0
        assert "WorkerDiedError: worker rank 1" in err and "exited with code -9" in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


# A user's script as vLLM's users write them: the engine at the top level, no `__main__` guard.
UNGUARDED_SCRIPT = textwrap.dedent("""\
    import json, sys
    from pagedllm import LLM, SamplingParams

    llm = LLM(tensor_parallel_size=3, dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate(json.loads(sys.argv[1]), params, use_tqdm=False)
    print(json.dumps([[o.outputs[0].token_ids, [{t: [lp.logprob, lp.rank] for t, lp in pos.items()}
                                                for pos in o.outputs[0].logprobs]] for o in outs]))
""")


def _outputs_from_json(rows: list) -> list:
    """RequestOutput-shaped objects from the script's JSON, for assert_same."""
    from types import SimpleNamespace as NS

    return [NS(outputs=[NS(token_ids=ids, logprobs=[{int(t): NS(logprob=v[0], rank=v[1]) for t, v in pos.items()}
                                                    for pos in lps])]) for ids, lps in rows]


@pytest.mark.slow
def test_unguarded_script_forks_its_workers(tmp_path) -> None:
    """The default model (9 heads: TP=3) in a script without the guard: the workers are forked,
    not spawned (which would run the script again in each), and compute what one rank does."""
    import json

    prompts = PROMPTS[:4]
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), json.dumps(prompts)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _outputs_from_json(json.loads(proc.stdout.strip().splitlines()[-1]))
    llm = LLM(dtype="float32", max_model_len=256)
    ref = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5),
                       use_tqdm=False)
    assert_same(ref, got)


@pytest.mark.slow
def test_unguarded_script_that_cannot_fork_says_so(tmp_path) -> None:
    """Once torch's OpenMP threads run, forking would hang the workers, and spawning would run the
    unguarded script again in each: the engine stops at once with one line naming the guard."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""\
        import torch
        torch.set_num_threads(2)
        torch.randn(512, 512) @ torch.randn(512, 512)
        torch.randn(1 << 22).exp().sum()
        from pagedllm import LLM
        LLM(tensor_parallel_size=3, dtype="float32")
    """))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 1 and time.monotonic() - t0 < 60
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedllm.executor.start_method.UnguardedMainError: the engine's 3 worker processes"), \
        proc.stderr[-3000:]
    assert f"{script}, line 6 again" in last and 'if __name__ == "__main__":' in last
    assert "worker rank" not in proc.stderr  # refused before any worker started


TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    torch.set_num_threads(1)
    from pagedllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="external_launcher",
              dtype="float32", max_model_len=256)
    prompts = json.loads(sys.argv[2])
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    with open(os.path.join(sys.argv[3], "rank" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    llm.llm_engine.shutdown()
""")


@pytest.mark.slow
def test_torchrun_external_launcher_matches_one_process(tiny8: str, tmp_path) -> None:
    import json

    from pagedllm.executor.multiproc import free_port

    prompts = PROMPTS[:6]
    llm = LLM(tiny8, dtype="float32", max_model_len=256)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)]
    script = tmp_path / "tr.py"
    script.write_text(TORCHRUN_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(script), tiny8, json.dumps(prompts), str(tmp_path)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):  # every rank's engine returns the driver's tokens
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == ref


@pytest.mark.slow
@pytest.mark.ray
def test_ray_executor_matches_one_process(tiny8: str, tiny_tp1: list[list]) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # a local head
    try:
        llm = LLM(tiny8, **{**TIGHT, **TINY_ROOM}, tensor_parallel_size=2, distributed_executor_backend="ray")
        try:
            assert_same(tiny_tp1[0], llm.generate(TINY_PROMPTS, GREEDY, use_tqdm=False))
        finally:
            llm.llm_engine.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(load_quant_kernel() is None, reason="--quantize-embeddings needs the native quantized kernel "
                                                       "(a C compiler; AVX-512 BF16, or AVX2 + FMA + F16C)")
def test_quantized_embeddings_shard_the_vocabulary(tiny8: str) -> None:
    """--quantize-embeddings under TP=2: each rank keeps its vocabulary rows' codes (per row, so the
    same codes as one rank's), looks up the ids it holds and gathers its logits. The linear layers
    stay dense (skip "*") so that only the vocabulary's codes are compared. The hidden states differ
    by float32 ulps (the row-parallel all-reduce's sum order), which the head's int8 activations
    (per 32 inputs, step max|x| / 127) can round to a neighbouring code: about 1e-3 of a logprob."""
    quant = {"quantization": "int8", "quantization_skip": "*", "quantize_embeddings": True}
    ref, got = (run(tiny8, PROMPTS[:6], **TINY_ROOM, **quant, tensor_parallel_size=tp) for tp in (1, 2))
    for r, g in zip(ref, got):
        assert_same(r, g, atol=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(load_quant_kernel() is None, reason="the native quantized kernel needs a C compiler and "
                                                       "AVX-512 BF16, or AVX2 + FMA + F16C")
def test_stored_codes_split_over_ranks(tiny8: str, tmp_path) -> None:
    """compressed-tensors codes under TP=2: row-parallel layers take their share of the codes'
    columns and of the per-group scales, column-parallel ones their rows. Same tokens and logprobs within 1e-3 as one rank (the all-reduce's sum order
    can move a value of the next layer's int8 activations by one step). act-order codes cannot be
    split by input columns and are refused with one error."""
    pytest.importorskip("compressed_tensors")
    from pagedllm.benchmarks.ct_export import act_order_pair, export_compressed
    from pagedllm.executor.multiproc import WorkerDiedError

    # 4-bit groups of 32 (a per-row scale repeated on the ranks: test_quantization.py)
    for preset, group in (("W4A16", 32),):
        qdir = str(tmp_path / preset)
        export_compressed(tiny8, qdir, preset, group)
        outs = []
        for tp in (1, 2):
            llm = LLM(qdir, **{**TIGHT, **TINY_ROOM}, tensor_parallel_size=tp)
            outs.append(llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False))
            llm.llm_engine.shutdown()
        assert_same(*outs, atol=1e-3)
    qdir, refdir = str(tmp_path / "act"), str(tmp_path / "act-ref")
    export_compressed(tiny8, qdir, "W4A16", 32, reference=refdir)
    act_order_pair(qdir, refdir, 32)
    with pytest.raises(WorkerDiedError, match="act-order"):
        LLM(qdir, dtype="float32", tensor_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_structured_output_mask_applies_across_ranks(tiny8: str, parallel: dict) -> None:
    """The grammar bitmask travels with the step to the rank that samples (the driver of the
    last stage): every reply matches its regex, and greedy replies equal one rank's."""
    from pagedllm import StructuredOutputsParams

    regexes = [r"[0-9]{2,6}", r"(cat|dog|bird)s?", r"[a-f]{3}-[0-9]"]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=TOP,
                             structured_outputs=StructuredOutputsParams(regex=r)) for r in regexes]
    prompts = PROMPTS[:3]
    outs = []
    for kwargs in ({}, parallel):
        llm = LLM(tiny8, **{**TIGHT, **TINY_ROOM, **kwargs})
        try:
            outs.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.llm_engine.shutdown()
    for r, o in zip(regexes, outs[1]):
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason == "length" or re.fullmatch(r, text), (r, text)
    assert_same(outs[0], outs[1])
