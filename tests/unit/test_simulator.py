"""pagedllm simulate: the simulated worker against the real one, determinism, the cost model's
units, trace validation and the command line."""

from __future__ import annotations

import dataclasses
import json
import random
import types

import numpy as np
import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.simulator.calibrate import design, fit_profile, fitted_steps, nnls, refit_validation
from pagedllm.simulator.cost_model import CostModel, StepFeatures
from pagedllm.simulator.hardware import HardwareProfile, gpu_profile, load_profile
from pagedllm.simulator.model import SimModel, load_model_config
from pagedllm.simulator.runner import Simulation
from pagedllm.simulator.trace import TraceError, TraceRequest, load_trace, synthetic_trace
from pagedllm.simulator.worker import SimWorker

# A model whose units are easy to compute by hand: N = decoder params.
TOY = SimModel.from_dict({"layers": 2, "hidden": 8, "heads": 2, "kv_heads": 1, "intermediate": 16,
                          "vocab": 32, "dtype_bytes": 2}, "toy")
UNIT_HW = HardwareProfile(name="unit", gemm_flops=1e9, attn_flops=1e8, kv_read_bw=1e6, weight_read_bw=None,
                          step_overhead_s=0.001, per_seq_s=0.0001, per_sample_s=0.00001, prompt_step_s=0.002,
                          swap_bw=1e6, copy_bw=2e6, link_bw=1e6, link_latency_s=1e-5)


def test_cost_model_units_by_hand() -> None:
    s = TOY.shape
    # q, k, v, o + gate/up/down + 2 norms per layer, final norm: 2 * (64 + 2*8*4 + 64 + 3*8*16 + 16) + 8
    assert s.head_dim == 4 and TOY.shape.decoder_params == 2 * (64 + 64 + 64 + 384 + 16) + 8 == 1192
    assert TOY.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2 == 32
    cost = CostModel(TOY, UNIT_HW, block_size=4)
    f = StepFeatures(num_tokens=10, num_seqs=3, num_sampled=2, prefill_pairs=55, decode_context=100,
                     swap_blocks=2, copy_blocks=1)
    c = cost.step_time(f)
    assert c.overhead == pytest.approx(0.001 + 3 * 0.0001)  # no prompt tokens: no prompt_step_s
    assert cost.step_time(dataclasses.replace(f, prefill_tokens=4)).overhead == pytest.approx(0.001 + 3 * 0.0001 + 0.002)
    # 10 tokens x 2 x 1192 FLOPs at 1 GFLOP/s, plus 2 lm_head rows (2 x 8 x 32 FLOPs) and the sampler.
    assert c.gemm == pytest.approx(10 * 2384 / 1e9 + 2 * (512 / 1e9 + 1e-5))
    # 55 pairs x 4 x 2 layers x 2 heads x 4 dims at 0.1 GFLOP/s.
    assert c.prefill_attention == pytest.approx(55 * 64 / 1e8)
    # 100 context tokens x 32 bytes at 1 MB/s.
    assert c.decode_attention == pytest.approx(100 * 32 / 1e6)
    # 2 swapped blocks of 4 x 32 bytes at 1 MB/s, one copied at 2 MB/s.
    assert c.moves == pytest.approx(2 * 128 / 1e6 + 128 / 2e6)
    assert c.comm == 0
    assert c.total == pytest.approx(c.overhead + c.gemm + c.prefill_attention + c.decode_attention + c.moves)


def test_cost_model_parallel_terms_by_hand() -> None:
    tp2 = CostModel(TOY, UNIT_HW, block_size=4, tp=2)
    # 2 layers x 2 all-reduces of 10 tokens x 8 hidden x 2 bytes: latency + 2 (2-1)/2 x 160 B / 1 MB/s.
    assert tp2.comm_time(10) == pytest.approx(4 * (1e-5 + 160 / 1e6))
    pp2 = CostModel(TOY, UNIT_HW, block_size=4, pp=2)
    assert pp2.comm_time(10) == pytest.approx(1e-5 + 160 / 1e6)
    # TP halves the GEMM work per device; the one KV head cannot be split, so decode reads stay whole.
    f = StepFeatures(num_tokens=10, decode_context=100)
    one = CostModel(TOY, UNIT_HW, block_size=4)
    assert tp2.step_time(f).gemm == pytest.approx(one.step_time(f).gemm / 2)
    assert tp2.step_time(f).decode_attention == pytest.approx(one.step_time(f).decode_attention)
    # Roofline floor: a GPU profile streams all weights in a 1-token step.
    h100 = gpu_profile("h100")
    m70 = load_model_config("llama3-70b")
    c = CostModel(m70, h100, 16, tp=8).step_time(StepFeatures(num_tokens=1, num_seqs=1))
    assert c.gemm >= m70.weight_bytes / 8 / h100.weight_read_bw
    assert 0.004 < c.gemm < 0.01  # ~141 GB / 8 / 2.68 TB/s = 6.6 ms


def test_builtin_profiles_and_errors(tmp_path) -> None:
    h200 = load_profile("h200")
    assert h200.kv_read_bw == pytest.approx(4.8e12 * 0.8) and h200.gemm_flops == pytest.approx(989e12 * 0.65)
    p = tmp_path / "p.json"
    h200.save(p)
    assert load_profile(str(p)) == h200
    p.write_text(json.dumps({**h200.to_dict(), "gemm_flops": -1}))
    with pytest.raises(ValueError, match="gemm_flops must be positive"):
        load_profile(str(p))
    with pytest.raises(ValueError, match="neither a file"):
        load_profile("tpu-v9")
    with pytest.raises(ValueError, match="lacks"):
        SimModel.from_dict({"layers": 1}, "bad")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"arrival_s": 0, "prompt_len": -3, "output_len": 4}', "prompt_len and output_len must be at least 1"),
        ('{"arrival_s": 0, "prompt_len": 3}', "missing field(s) ['output_len']"),
        ('{"arrival_s": 0.5, "prompt_len": 3, "output_len": 4}', "earlier than the previous line"),
        ('{"arrival_s": 2, "prompt_len": 3.5, "output_len": 4}', "prompt_len must be an integer"),
        ('{"arrival_s": 2, "prompt_len": 3, "output_len": 4, "prefix_len": 2}', "needs a prefix_id"),
        ('not json', "not valid JSON"),
    ],
)
def test_malformed_trace_names_the_line(tmp_path, line: str, message: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival_s": 1.0, "prompt_len": 8, "output_len": 2}\n\n' + line + "\n")
    with pytest.raises(TraceError) as e:
        load_trace(p)
    assert f"{p}:3:" in str(e.value) and message in str(e.value)


def _trace(n: int = 60, seed: int = 3) -> list[TraceRequest]:
    return synthetic_trace(n, 50.0, "4:60", "1:20", arrival="bursty", seed=seed, num_users=3, num_prefixes=2,
                           prefix_len=12)


@pytest.mark.parametrize("policy, mode", [("fcfs", "swap"), ("srtf", "recompute"), ("fair", "auto"),
                                          ("priority", "swap")])
def test_simulation_keeps_integrity_and_is_deterministic(policy: str, mode: str) -> None:
    """A small pool forces preemption; the scheduler's and the worker's checks run every step."""
    trace = _trace()
    sc = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8, max_model_len=128, policy=policy,
                         preemption_mode=mode, time_slice=4, user_weights={"user0": 2.0})
    cc = CacheConfig(block_size=4, num_kv_blocks=40)
    runs = []
    for _ in range(2):
        cost = CostModel(TOY, UNIT_HW, 4)
        res = Simulation(sc, cc, cost, 40, 0 if mode == "recompute" else 20, check_integrity=True).run(trace)
        runs.append(res)
    a, b = runs
    assert all(r.finish_s >= r.first_token_s >= r.arrival_s for r in a.requests)
    assert sum(a.preemptions_by_mode.values()) > 0
    if mode == "swap":
        assert a.preemptions_by_mode["swap"] > 0
    assert a.prefix_hit_rate > 0
    assert [(r.first_token_s, r.finish_s) for r in a.requests] == [(r.first_token_s, r.finish_s) for r in b.requests]
    assert (a.num_steps, a.sim_elapsed_s, a.time_by_term) == (b.num_steps, b.sim_elapsed_s, b.time_by_term)


def test_worker_matches_real_worker(tiny_model_dir: str, one_torch_thread) -> None:
    """Same SchedulerOutputs into the real model runner and the simulated worker: the same request
    ids in the same order and the same rows sampled, every step (forks, swaps and prefix hits)."""
    from pagedllm.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(tiny_model_dir, num_kv_blocks=24, block_size=4, preemption_mode="swap", swap_space=0.001,
              max_num_batched_tokens=32, dtype="float32")
    eng = llm.llm_engine
    sim = SimWorker(4, check=True)
    real_execute = eng.executor.execute_model
    compared = []

    def both(so):
        out = real_execute(so)
        sim_out, feats = sim.execute_model(so)
        assert sim_out.req_ids == out.req_ids
        assert [len(t) for t in sim_out.sampled_token_ids] == [len(t) for t in out.sampled_token_ids]
        assert feats.num_tokens == so.total_num_scheduled_tokens
        compared.append(feats)
        return out

    eng.executor.execute_model = both
    rng = random.Random(0)
    prefix = [rng.randrange(10, 300) for _ in range(12)]
    for i in range(8):
        prompt = (prefix if i % 2 else []) + [rng.randrange(10, 300) for _ in range(rng.randint(3, 20))]
        params = SamplingParams(max_tokens=rng.randint(2, 12), ignore_eos=True, temperature=0.0, n=2 if i == 3 else 1)
        eng.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while eng.has_unfinished_requests():
        eng.step()
        eng.scheduler.check_integrity()
    assert len(compared) > 10
    assert eng.scheduler.num_preemptions_by_mode["swap"] > 0
    assert any(f.swap_blocks for f in compared) and any(f.decode_tokens for f in compared)


def test_fit_recovers_known_rates() -> None:
    rng = np.random.default_rng(0)
    # Half the steps compute prompt tokens (pairs > 0, indicator 1), half are decode-only.
    rows = [[1.0, t, p * (i % 2), c, s, k, float(i % 2)]
            for i, (t, p, c, s, k) in enumerate(rng.integers(1, 500, size=(200, 5)).tolist())]
    truth = np.array([0.01, 2e-3, 1e-6, 5e-6, 1e-4, 1e-3, 0.02])  # per sample > the lm_head row (4.3e-4)
    secs = (np.asarray(rows) @ truth).tolist()
    assert np.allclose(nnls(np.asarray(rows), np.asarray(secs)), truth, atol=1e-9)
    prof, fit = fit_profile(TOY, rows, secs, 1e9, 1 << 30, "fit")
    assert prof.gemm_flops == pytest.approx(TOY.flops_per_token / 2e-3)
    assert prof.step_overhead_s == pytest.approx(0.01) and fit["mean_abs_rel_err"] < 1e-9
    assert prof.prompt_step_s == pytest.approx(0.02)
    cost = CostModel(TOY, prof, 16)
    prompt = StepFeatures(num_tokens=7, prefill_tokens=5, prefill_pairs=30, decode_context=40, num_seqs=3)
    decode = StepFeatures(num_tokens=3, decode_tokens=3, decode_context=40, num_seqs=3, num_sampled=3)
    for f in (prompt, decode):
        assert cost.step_seconds(f) == pytest.approx(float(np.dot(f.as_row(), truth)))
    assert cost.step_seconds(prompt) - cost.step_seconds(dataclasses.replace(prompt, prefill_tokens=0)) == (
        pytest.approx(0.02))


def test_small_steps_get_their_own_rates() -> None:
    """Steps of at most small_step_tokens tokens: their tokens and prompt indicator go to the small-step
    columns of the fit, and the cost model prices them at the small-step rates it recovers."""
    rows = [[1.0, 8, 30, 40, 2, 2, 1.0], [1.0, 9, 0, 40, 9, 9, 0.0], [1.0, 300, 900, 0, 3, 3, 1.0]]
    x = design(rows, 8)
    assert x.tolist() == [[1, 0, 30, 40, 2, 2, 0, 8, 1], [1, 9, 0, 40, 9, 9, 0, 0, 0], [1, 300, 900, 0, 3, 3, 1, 0, 0]]
    assert design(rows, 0)[:, 7:].sum() == 0 and design(rows, 0)[:, 1].tolist() == [8, 9, 300]
    rng = np.random.default_rng(1)
    rows = [[1.0, t, p * (i % 2), c, s, k, float(i % 2)]
            for i, (t, p, c, s, k) in enumerate(rng.integers(1, 500, size=(300, 5)).tolist())]
    rows += [[1.0, t, p * (i % 2), c, s, k, float(i % 2)]
             for i, (t, p, c, s, k) in enumerate(rng.integers(1, 64, size=(300, 5)).tolist())]
    truth = np.array([0.01, 2e-3, 1e-6, 5e-6, 1e-4, 1e-3, 0.02, 5e-4, 0.004])
    secs = (design(rows, 64) @ truth).tolist()
    prof, fit = fit_profile(TOY, rows, secs, 1e9, 1 << 30, "fit", small_tokens=64)
    assert fit["mean_abs_rel_err"] < 1e-9 and prof.small_step_tokens == 64
    assert prof.small_step_gemm_flops == pytest.approx(TOY.flops_per_token / 5e-4)
    assert prof.small_prompt_step_s == pytest.approx(0.004) and prof.prompt_step_s == pytest.approx(0.02)
    cost = CostModel(TOY, prof, 16)
    for n in (1, 64, 65, 400):
        for prompt in (0, 7):
            f = StepFeatures(num_tokens=n, prefill_tokens=min(prompt, n), prefill_pairs=3 * bool(prompt),
                             decode_context=40, num_seqs=3, num_sampled=2)
            assert cost.step_seconds(f) == pytest.approx(float(design([f.as_row()], 64)[0] @ truth))
    # Small steps whose tokens the fit finds no cost for (here cheaper by the token than none): their
    # tokens are fitted again at the larger steps' rate instead of failing the calibration.
    cheap = np.array([0.01, 2e-3, 1e-6, 5e-6, 1e-4, 1e-3, 0.02, -2e-4, 0.004])
    prof, fit = fit_profile(TOY, rows, (design(rows, 64) @ cheap).tolist(), 1e9, 1 << 30, "fit", small_tokens=64)
    assert prof.small_step_gemm_flops is None and fit["coefficients"]["per_small_step_token_s"] == 0
    assert prof.gemm_flops > 0 and prof.small_step_tokens == 64
    with pytest.raises(ValueError, match="small_step_tokens"):
        dataclasses.replace(UNIT_HW, small_step_tokens=-1)
    with pytest.raises(ValueError, match="small_step_gemm_flops"):
        dataclasses.replace(UNIT_HW, small_step_gemm_flops=0.0)


def test_refit_of_a_stored_validation_reproduces_it(tmp_path, monkeypatch, capsys) -> None:
    """`simulate calibrate --refit`: a committed validation (the Zen 4 class host, float32, one
    thread) fitted and simulated again from its stored steps and traces, without the engine. With
    one cost for all steps, as it was written, every row comes out as recorded, to the bit. The JSON
    it writes names the steps' file instead of copying them, and reads back with them."""
    from pathlib import Path

    from pagedllm.entrypoints.cli import main
    from pagedllm.simulator.calibrate import load_validation

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    name = "benchmarks/results/sim/zen4-validation.json"
    stored = json.loads(Path(name).read_text())
    out = tmp_path / "v.json"
    assert main(["simulate", "calibrate", "--refit", name, "--small-step-tokens", "0", "--validate", str(out)]) == 0
    assert "held out: 48 requests" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["steps_file"] == name and "calibration_steps" not in written and written["rows"] == stored["rows"]
    again = load_validation(str(out))
    assert again["calibration_steps"] == stored["calibration_steps"]
    assert again["validation_steps"] == stored["validation_steps"]
    fit, profile = written["fit"], written["profile"]
    assert fit["coefficients"]["per_small_step_token_s"] == 0 and fit["num_steps"] == stored["fit"]["num_steps"]
    assert profile["name"] == stored["profile"]["name"] and profile["small_step_tokens"] == 0
    for key in ("step_overhead_s", "gemm_flops", "prompt_step_s", "per_sample_s"):
        assert profile[key] == stored["profile"][key], key
    old = {**stored, "rows": [{k: v for k, v in r.items() if k != "held_out"} for r in stored["rows"]]}
    with pytest.raises(ValueError, match="row 0 has no 'held_out'"):
        refit_validation(old)


def test_refit_finds_the_steps_file_from_another_directory(tmp_path, monkeypatch, capsys) -> None:
    """A committed refit names its steps' file from the repository root; run from another directory,
    that path is found again from the validation file's folder (here from the folder above it that
    holds it), the JSON the refit writes names it in the same form, and a path that is found nowhere
    is an error naming the path given and the one resolved against the validation file's folder."""
    from pathlib import Path

    from pagedllm.entrypoints.cli import main
    from pagedllm.simulator.calibrate import load_validation

    repo = Path(__file__).resolve().parents[2]
    refit = repo / "benchmarks/results/sim/zen4-validation-refit.json"
    steps_file = json.loads(refit.read_text())["steps_file"]
    assert not Path(steps_file).is_absolute()
    source = json.loads((repo / steps_file).read_text())
    monkeypatch.chdir(tmp_path)
    assert not Path(steps_file).exists()
    stored = load_validation(str(refit))
    assert stored["steps_file"] == steps_file
    assert stored["calibration_steps"] == source["calibration_steps"]
    assert stored["validation_steps"] == source["validation_steps"]
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "v.json"
    assert main(["simulate", "calibrate", "--refit", str(refit), "--small-step-tokens", "0",
                 "--validate", str(out)]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["steps_file"] == steps_file
    # The same name in a validation file outside the repository is found nowhere.
    with pytest.raises(ValueError) as e:
        load_validation(str(out))
    for named in (repr(steps_file), str(tmp_path.resolve() / steps_file), str(out.resolve().parent / steps_file)):
        assert named in str(e.value), named
    # A bare name is found beside the validation file that names it; an absolute path is used as given.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "steps.json").write_text(json.dumps(source))
    bare = tmp_path / "sub" / "bare.json"
    bare.write_text(json.dumps({**json.loads(out.read_text()), "steps_file": "steps.json"}))
    assert load_validation(str(bare))["validation_steps"] == source["validation_steps"]
    bare.write_text(json.dumps({**json.loads(out.read_text()), "steps_file": str(repo / steps_file)}))
    assert load_validation(str(bare))["calibration_steps"] == source["calibration_steps"]


def test_held_out_steps_are_in_no_fit() -> None:
    calib = [([1.0] * 7, 0.5)]
    runs = [{"held_out": False, "run": types.SimpleNamespace(steps=[([2.0] * 7, 1.0)])},
            {"held_out": False, "run": types.SimpleNamespace(steps=[([3.0] * 7, 2.0)])},
            {"held_out": True, "run": types.SimpleNamespace(steps=[([4.0] * 7, 3.0)])}]
    assert [t for _, t in fitted_steps(calib, runs)] == [0.5, 1.0, 2.0]
    assert [t for _, t in fitted_steps(calib, runs, leave_out=0)] == [0.5, 2.0]
    assert [t for _, t in fitted_steps(calib, runs, leave_out=2)] == [0.5, 1.0, 2.0]


def test_cli_simulate_json_sweep_and_errors(tmp_path, capsys) -> None:
    from pagedllm.entrypoints.cli import main

    mc = tmp_path / "m.json"
    mc.write_text(json.dumps(TOY.to_dict()))
    trace = tmp_path / "t.jsonl"
    common = ["simulate", "--model-config", str(mc), "--profile", "h200", "--num-requests", "40",
              "--request-rate", "200", "--prompt-lens", "8:64", "--output-lens", "4:16", "--num-kv-blocks", "64",
              "--block-size", "8", "--check-integrity"]
    out = tmp_path / "r.json"
    assert main([*common, "--save-trace", str(trace), "--output-json", str(out), "--plot",
                 str(tmp_path / "r.png")]) == 0
    rep = json.loads(out.read_text())
    for k in ("elapsed_s", "output_tok_s", "mean_ttft_s", "p99_ttft_s", "mean_tpot_s", "goodput_requests_s"):
        assert rep[k] > 0, k
    assert rep["num_finished"] == 40 and (tmp_path / "r.png").stat().st_size > 0
    again = tmp_path / "r2.json"
    assert main([*common, "--trace", str(trace), "--output-json", str(again)]) == 0
    assert json.loads(again.read_text())["elapsed_s"] == rep["elapsed_s"]
    sweep = tmp_path / "s.json"
    assert main([*common, "--sweep", "block_size=4,8", "max_num_batched_tokens=32,256", "--output-json",
                 str(sweep), "--plot", str(tmp_path / "s.png")]) == 0
    rows = json.loads(sweep.read_text())["sweep"]
    assert [r["params"] for r in rows] == [{"block_size": b, "max_num_batched_tokens": m}
                                          for b in (4, 8) for m in (32, 256)]
    capsys.readouterr()
    trace.write_text('{"arrival_s": 0, "prompt_len": 0, "output_len": 4}\n')
    assert main([*common, "--trace", str(trace)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{trace}:1: prompt_len and output_len must be at least 1" in err[0]
    assert main([*common, "--sweep", "colour=red"]) == 2
    assert "not an engine flag" in capsys.readouterr().err


def test_calibrate_flags_parse_beside_simulate_flags() -> None:
    """`simulate calibrate --output X` is the calibrate flag, not an abbreviation of --output-json."""
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["simulate", "calibrate", "--output", "p.json", "--quick"])
    assert args.output == "p.json" and args.quick and args.func.__name__ == "cmd_calibrate"


def test_refit_flag_errors_name_the_file(tmp_path, capsys) -> None:
    from pagedllm.entrypoints.cli import main

    missing = tmp_path / "missing.json"
    assert main(["simulate", "calibrate", "--refit", str(missing), "--output", str(tmp_path / "p.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    assert main(["simulate", "calibrate", "--refit", str(other), "--output", str(tmp_path / "p.json")]) == 2
    assert "has no 'profile'" in capsys.readouterr().err
    assert main(["simulate", "calibrate", "--refit", str(other), "--small-step-tokens", "-1"]) == 2
    assert "--small-step-tokens must be non-negative, got -1" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
