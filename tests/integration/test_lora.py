"""Batched multi-LoRA against PEFT: greedy tokens and logprobs of a tiny random Llama with
PEFT-written adapters (random non-zero A and B: attention only, MLP only, every linear layer with
rsLoRA) equal transformers + PEFT's in float32 (logprobs within 1e-4), in one batch that mixes
the adapters with base-model rows; more adapters than slots wait and are reloaded from their
folders (LRU); a prompt under two adapters never shares KV blocks; bad adapters are refused at
load, naming the tensor, with the engine unharmed; Phi-3's fused qkv / gate_up adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.layers import lora_amx
from pagedllm.models.testing import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 8
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23], [40, 41, 42, 43, 44, 45], [30, 31, 32, 33, 34]]


def make_adapter(base: str, out: Path, seed: int, **lora_kwargs) -> str:
    """A PEFT adapter of `base` with random non-zero A and B, saved by PEFT into `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():  # large enough deltas that every adapter changes the greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(str(out))
    return str(out)


def peft_reference(base: str, adapter: str | None, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's logprob from transformers (+ PEFT), float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return ids[len(prompt):], logprobs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(str(root / "base"), arch="llama")
    adapters = {
        "attn": make_adapter(base, root / "attn", 1, r=8, lora_alpha=16,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "mlp": make_adapter(base, root / "mlp", 2, r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
        "all": make_adapter(base, root / "all", 3, r=6, lora_alpha=12, target_modules="all-linear", use_rslora=True),
    }
    llm = LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8, dtype="float32",
              kv_cache_memory="32MiB", block_size=4)
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    return root, base, adapters, requests, llm


def _runner(llm):
    return llm.llm_engine.core.executor.runner


def test_mixed_batch_equals_peft(setup):
    _, base, adapters, requests, llm = setup
    # 3 adapters over 2 slots and 2 host-cached adapters: the scheduler runs at most 2 at once,
    # the third waits (the base rows go on) and an adapter is dropped and read again.
    plan = [("attn", 0), (None, 0), ("mlp", 1), ("all", 2), ("attn", 3), (None, 2), ("all", 0), ("mlp", 0)]
    loads_before = _runner(llm).lora.num_loads
    outs = llm.generate([PROMPTS[p] for _, p in plan], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                      logprobs=0),
                        lora_request=[requests[a] if a else None for a, _ in plan], use_tqdm=False)
    cache: dict = {}
    for (name, p), out in zip(plan, outs):
        key = (name, p)
        if key not in cache:
            cache[key] = peft_reference(base, adapters[name] if name else None, PROMPTS[p])
        tokens, logprobs = cache[key]
        got = out.outputs[0]
        assert list(got.token_ids) == tokens, (name, p)
        got_lp = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert got_lp == pytest.approx(logprobs, abs=1e-4), (name, p)
    # every adapter changes the tokens
    assert len({tuple(cache[(n, 0)][0]) for n in (None, "attn", "all", "mlp")}) == 4
    assert _runner(llm).lora.num_loads - loads_before >= 3
    assert len(_runner(llm).lora.cpu_cache) <= 2


def test_batch_equals_each_request_alone(setup):
    _, _, _, requests, llm = setup
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    loras = [requests["attn"], None, requests["all"], requests["attn"]]
    together = llm.generate(PROMPTS, sp, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(PROMPTS, loras, together):
        alone = llm.generate([prompt], sp, lora_request=lora, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_prefix_cache_is_keyed_by_adapter(setup):
    _, base, adapters, requests, llm = setup
    prompt = list(range(50, 70))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    first = llm.generate([prompt], sp, lora_request=requests["attn"], use_tqdm=False)[0]
    again = llm.generate([prompt], sp, lora_request=requests["attn"], use_tqdm=False)[0]
    other = llm.generate([prompt], sp, lora_request=requests["mlp"], use_tqdm=False)[0]
    plain = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert list(other.outputs[0].token_ids) == peft_reference(base, adapters["mlp"], prompt)[0]
    assert list(plain.outputs[0].token_ids) == peft_reference(base, None, prompt)[0]


def _broken(src: str, dst: Path, edit) -> str:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    cfg = json.loads((dst / "adapter_config.json").read_text())
    tensors, cfg = edit(tensors, cfg)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def _rename(tensors, old, new):
    return {k.replace(old, new): v for k, v in tensors.items()}


@pytest.mark.parametrize("case, pattern", [
    ("rank", r"layers\.0\.self_attn\.q_proj\.lora_A.* rank 16, over --max-lora-rank 8"),
    ("shape", r"tensor 'model\.layers\.0\.mlp\.up_proj\.lora_A\.weight' has 32 input columns"),
    ("unknown", r"tensor 'model\.layers\.7\.[a-z_.]*\.lora_A\.weight' adapts a module that"),
    ("modules_to_save", r"modules_to_save=\['lm_head'\]"),
    ("missing", r"module 'model\.layers\.0\.self_attn\.q_proj' has no lora_B"),
])
def test_bad_adapters_are_refused(setup, case, pattern):
    root, base, adapters, _, llm = setup
    src = adapters["all"]
    if case == "rank":
        path = make_adapter(base, root / "rank16", 9, r=16, lora_alpha=16, target_modules=["q_proj"])
    elif case == "shape":
        def edit(t, c):
            k = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
            return {**t, k: t[k][:, :32].contiguous()}, c
        path = _broken(src, root / f"bad-{case}", edit)
    elif case == "unknown":
        path = _broken(src, root / f"bad-{case}", lambda t, c: (_rename(t, "layers.1.", "layers.7."), c))
    elif case == "modules_to_save":
        path = _broken(src, root / f"bad-{case}", lambda t, c: (t, {**c, "modules_to_save": ["lm_head"]}))
    else:
        path = _broken(src, root / f"bad-{case}", lambda t, c: (
            {k: v for k, v in t.items() if k != "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"}, c))
    with pytest.raises(ValueError, match=pattern):
        llm.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(max_tokens=2),
                     lora_request=[None, LoRARequest(case, 100 + len(case), path)], use_tqdm=False)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2  # the engine serves on


@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_unreadable_adapter_fails_its_requests_only(setup, tmp_path, damage):
    # The front end checked the adapter; its folder is then deleted or corrupted before a worker
    # reads it: its requests end with an error naming the folder, the other rows of the same
    # steps complete with their own tokens, and the engine serves on.
    import shutil

    _, base, adapters, requests, llm = setup
    folder = tmp_path / "adapter"
    shutil.copytree(adapters["mlp"], folder)
    gone = LoRARequest("gone-" + damage, {"deleted": 61, "corrupt": 62}[damage], str(folder))
    engine = llm.llm_engine
    engine.processor.check_lora(gone)
    if damage == "deleted":
        shutil.rmtree(folder)
    else:
        (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    plan = {"plain": (PROMPTS[0], None), "bad": (PROMPTS[1], gone), "attn": (PROMPTS[2], requests["attn"]),
            "bad2": (PROMPTS[3], gone)}
    for rid, (prompt, lora) in plan.items():
        engine.add_request(f"{damage}-{rid}", prompt, sp, lora_request=lora)
    done, errors = {}, []
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished:
                    done[out.request_id.removeprefix(f"{damage}-")] = list(out.outputs[0].token_ids)
        except RuntimeError as e:
            errors.append(str(e))
    assert set(done) == {"plain", "attn"}
    assert errors and all(f"LoRA adapter {gone.lora_int_id} cannot be read from {str(folder)!r}" in e for e in errors)
    assert done["plain"] == peft_reference(base, None, PROMPTS[0])[0]
    assert done["attn"] == peft_reference(base, adapters["attn"], PROMPTS[2])[0]
    out = llm.generate([PROMPTS[1]], sp, lora_request=requests["mlp"], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == peft_reference(base, adapters["mlp"], PROMPTS[1])[0]


def test_lora_needs_enable_lora_and_distinct_ids(setup, tmp_path):
    _, _, adapters, requests, llm = setup
    with pytest.raises(ValueError, match="already bound"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("x", requests["attn"].lora_int_id, adapters["mlp"]), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, adapters["mlp"])


def test_phi3_fused_qkv_and_gate_up(tmp_path):
    import transformers as t

    from pagedllm.models.testing import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    config = t.Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=96, max_position_embeddings=256, vocab_size=len(tok), pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    t.Phi3ForCausalLM(config).float().save_pretrained(str(tmp_path / "base"))
    tok.save_pretrained(str(tmp_path / "base"))
    base = str(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "ad", 4, r=4, lora_alpha=8,
                           target_modules=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"])
    llm = LLM(base, enable_lora=True, max_lora_rank=4, dtype="float32", kv_cache_memory="16MiB")
    out = llm.generate([PROMPTS[0], PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                       lora_request=[LoRARequest("ad", 1, adapter), None], use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == peft_reference(base, adapter, PROMPTS[0])[0]
    assert list(out[1].outputs[0].token_ids) == peft_reference(base, None, PROMPTS[0])[0]


def test_native_decode_step_kept_for_base_rows(setup):
    runner = _runner(setup[4])
    if runner.native_kernel is None:
        pytest.skip("no C compiler for the native kernels")
    assert runner.native_decode is not None  # steps without adapter rows keep the fused decode step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_step_adds_the_deltas(setup, dtype):
    # Decode steps with adapter rows run as the one fused native call (each row's deltas added
    # after every base GEMM, inside the call); tokens and logprobs equal the torch path's, with 4
    # adapters over 3 slots, base rows among them.
    root, base, adapters, requests, llm = setup
    if dtype != "float32":
        llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, dtype=dtype, kv_cache_memory="32MiB",
                  block_size=4)
    runner = _runner(llm)
    if runner.native_decode is None:
        pytest.skip("no fused native decode step here")
    nd = runner.native_decode
    assert nd.lora
    if dtype == "bfloat16" and lora_amx():  # the step's deltas run on AMX tiles, as the torch path's do
        assert all(nd.model.lora_qkv[i].ap for i in range(nd.model.num_layers))
    extra = LoRARequest("attn2", 9, make_adapter(base, root / f"attn2-{dtype}", 11, r=8, lora_alpha=8,
                                                 target_modules=["q_proj", "v_proj", "down_proj"]))
    loras = [requests["attn"], None, requests["mlp"], requests["all"], extra, requests["attn"], None, extra]
    prompts = [PROMPTS[i % 4] for i in range(len(loras))]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    calls = []
    if dtype == "bfloat16":  # two threads: the step's team, each thread expanding the columns it computed
        torch.set_num_threads(2)
    run, run_head = nd.run, nd.run_head

    def record(fn, slots_arg):  # the LoRA slots of each fused call the kernel took
        def wrapped(*a):
            out = fn(*a)
            if out is not None and len(a) > slots_arg and a[slots_arg] is not None:
                calls.append(a[slots_arg])
            return out
        return wrapped

    nd.run, nd.run_head = record(run, 5), record(run_head, 9)
    # (each run its own cache salt: both compute every prompt, no prefix cache hit)
    fused = llm.generate(prompts, sp, lora_request=loras, cache_salt=["fused"] * len(prompts), use_tqdm=False)
    nd.run, nd.run_head = run, run_head
    assert any((c >= 0).any() for c in calls)
    runner.native_decode = None  # the torch path
    try:
        eager = llm.generate(prompts, sp, lora_request=loras, cache_salt=["eager"] * len(prompts), use_tqdm=False)
    finally:
        runner.native_decode = nd
        torch.set_num_threads(1)
    # bfloat16: the same bits (the step follows the torch path's rounding points and GEMM blocking,
    # and its deltas are the torch path's native LoRA kernel's); float32 GEMM sums run in another
    # order than MKL's / oneDNN's (tests/unit/test_native_decode.py): within 1e-4.
    for f, e in zip(fused, eager):
        assert f.outputs[0].token_ids == e.outputs[0].token_ids
        got, want = ([{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in (f, e))
        if dtype == "bfloat16":
            assert got == want
        else:
            assert [sorted(d) for d in got] == [sorted(d) for d in want]
            assert [v for d in got for v in d.values()] == pytest.approx([v for d in want for v in d.values()],
                                                                          abs=1e-4)
    assert len({tuple(o.outputs[0].token_ids) for o in fused[:4]}) == 4


@pytest.mark.slow
def test_tensor_parallel_equals_one_rank(setup):
    _, base, adapters, requests, llm = setup
    loras = [requests["attn"], None, requests["all"], requests["mlp"]]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    one = llm.generate(PROMPTS, sp, lora_request=loras, use_tqdm=False)
    tp = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, dtype="float32", kv_cache_memory="16MiB",
             tensor_parallel_size=2)
    try:
        two = tp.generate(PROMPTS, sp, lora_request=loras, use_tqdm=False)
    finally:
        tp.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_adapter_requests_equal_peft(setup, mode):
    _, base, adapters, requests, _ = setup
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", num_kv_blocks=12,
              block_size=4, preemption_mode=mode, swap_space=0.01)
    try:
        loras = [requests["attn"], requests["all"], None, requests["attn"]]
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora_request=loras,
                            use_tqdm=False)
        assert llm.llm_engine.scheduler.get_stats().num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()
    for prompt, lora, out in zip(PROMPTS, loras, outs):
        assert list(out.outputs[0].token_ids) == peft_reference(base, lora and adapters[lora.lora_name], prompt)[0]


@pytest.mark.parametrize("kwargs", [dict(dtype="bfloat16"), dict(dtype="float16"),
                                    dict(dtype="float32", quantization="int8"),
                                    dict(dtype="bfloat16", lora_dtype="float32")])
def test_other_dtypes_and_quantized_base_follow_peft(setup, kwargs):
    """Against PEFT in float32: equal greedy tokens, or at the first differing position a token
    whose float32 logprob is within 0.5 nat of PEFT's choice (this tiny random model's candidates
    lie within tenths of a nat of each other, and 16-bit hidden states under these large random
    adapters move logprobs by up to about 0.2 nat)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, base, adapters, requests, _ = setup
    llm = LLM(base, enable_lora=True, max_lora_rank=8, kv_cache_memory="16MiB", **kwargs)
    try:
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=5),
                           lora_request=requests["all"], use_tqdm=False)[0].outputs[0]
    finally:
        llm.llm_engine.shutdown()
    ref, _ = peft_reference(base, adapters["all"], PROMPTS[0])
    got = list(out.token_ids)
    if got == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapters["all"])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([PROMPTS[0] + ref[:i]])).logits[0, -1], -1)
    assert lp[got[i]] >= lp[ref[i]] - 0.5, (i, float(lp[got[i]]), float(lp[ref[i]]))


def test_adapters_need_enable_lora(setup):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.lora.registry import LoRAChecker

    _, base, adapters, requests, _ = setup
    config = EngineArgs(model=base).create_engine_config()
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        LoRAChecker(config).check(requests["attn"])
    with pytest.raises(ValueError, match="pipeline_parallel_size=1"):
        EngineArgs(model=base, enable_lora=True, pipeline_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be at least max_loras=2"):
        EngineArgs(model=base, enable_lora=True, max_loras=2, max_cpu_loras=1).create_engine_config()


def test_chunked_prompts_equal_peft(setup):
    _, base, adapters, requests, _ = setup
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", kv_cache_memory="16MiB",
              long_prefill_token_threshold=3)  # every prompt in chunks of 3 tokens, beside other rows
    try:
        loras = [requests["all"], None, requests["mlp"], requests["all"]]
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora_request=loras,
                            use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, lora, out in zip(PROMPTS, loras, outs):
        assert list(out.outputs[0].token_ids) == peft_reference(base, lora and adapters[lora.lora_name], prompt)[0]
