"""The fused native decode step on quantized linear layers, against the torch path.

Each quantized linear layer runs the same kernel function (linear_quant.c) in both paths on the
same bf16 activations, so in bfloat16 the step equals the torch path to the bit at every row count
where all four linear layers are quantized; a dense linear layer keeps the dense step's rule (bit
for bit up to the small-M kernel's rows, oneDNN's sum order above). In float32 the paths differ by the order of
sums in the norms and attention (float32 ulps), and such a difference can move an activation
across a bf16 rounding boundary on its way into a quantized kernel: one bf16 ulp (2^-8 relative)
of one of 64 inputs, about 1e-3 of an output at most, hence the float32 tolerance. w8a8 layers
take the activations as they are (float32 here) and quantize each row with one scale, as its torch
path does: there such a difference can move one input's int8 code by one step, d = max|x| / 127,
which moves an output by d |w| of that input, inside the same tolerance on these models.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.quantization import kernels as K
from pagedllm.quantization.methods import GroupCodesLinearMethod, finish_group_codes
from pagedllm.quantization.native import load_quant_kernel
from pagedllm.layers.native_linear import small_m_rows
from pagedllm.worker.native_decode import NativeDecode, load_decode_kernel, quantized_rows
from test_native_decode import _both_paths, _decode_batch, head_three_ways, tiny_llama_dir  # noqa: F401 (a fixture)
from test_quant_native import _int8_act_bound

_AVAIL = load_decode_kernel().small_m_available() if load_decode_kernel() is not None else 0
pytestmark = pytest.mark.skipif(load_quant_kernel() is None or not _AVAIL & 1,
                                reason="no C compiler, or neither AVX-512 BF16 nor AVX2 + FMA")
# The dtype of the cases that run one: bfloat16 where the fused step takes it (AVX-512 BF16, or AVX2
# + FMA widening bf16; the bit-exact comparisons), else float32 (_check's tolerance).
STEP_DTYPE = "bfloat16" if _AVAIL & 2 else "float32"
BF16 = pytest.param("bfloat16", marks=pytest.mark.skipif(not _AVAIL & 2, reason="bfloat16 steps need a bf16 GEMM kernel"))

SCHEMES = {
    "int4": {"quantization": "int4", "quantization_group_size": 32},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "w8a8": {"quantization": "w8a8"},
    "ffn-int4": {"quantization": "int4", "quantization_skip": "attention"},  # qkv and o stay dense
}


def _runner(model_dir: str, dtype: str, **kwargs):
    llm = LLM(model=model_dir, dtype=dtype, num_kv_blocks=256, block_size=16, **kwargs)
    return llm, llm.llm_engine.core.executor.runner


def _check(runner, dtype: str, all_quantized: bool, rows_list=(1, 3, 16, 40)) -> None:
    """The fused step against the torch path at each of rows_list up to the step's rows (which
    follow the layers' kernels: quantized_rows)."""
    nd = runner.native_decode
    assert nd.max_rows == quantized_rows(nd.kinds, runner.dtype)
    for rows in [r for r in rows_list if r <= nd.max_rows]:
        batch = _decode_batch(runner, [5 + 29 * i % 90 for i in range(rows)], seed=rows)
        (ref, ref_kv), (out, out_kv) = _both_paths(runner, batch)
        assert out is not None and out.dtype == ref.dtype and out.shape == ref.shape
        if dtype == "bfloat16" and (all_quantized or rows <= small_m_rows(runner.dtype)):
            assert torch.equal(out, ref), rows
            assert all(torch.equal(a, b) for a, b in zip(out_kv, ref_kv))
        elif dtype == "bfloat16":  # dense layers above four rows: see test_native_decode.py
            torch.testing.assert_close(out.float(), ref.float(), rtol=2**-5, atol=2**-5)
        else:
            _close_but_for_rare_flips(out, ref, rows)
            for a, b in zip(out_kv, ref_kv):
                _close_but_for_rare_flips(a, b, rows)


def _close_but_for_rare_flips(a: torch.Tensor, b: torch.Tensor, rows: int) -> None:
    """float32: within 1e-3 (see the module's docstring), but for the values of at most one row in
    16 (at least one row), which stay within 2e-2. Where an activation that crosses a bf16 rounding
    boundary is the largest of its block of 32, it moves the block's int8 scale, and so every code
    of the block by up to half a step: on these models one row of 40 moved by 6e-3, one of 64 alike,
    every other row by at most 2.4e-7."""
    diff = (a.float() - b.float()).abs()
    assert float(diff.max()) <= 2e-2
    assert (diff > 1e-3 + 1e-3 * b.float().abs()).float().mean() <= max(1, rows // 16) / rows


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("dtype", [BF16, "float32"])
def test_quantized_step_matches_torch_path(scheme, dtype, tiny_model_dir, one_torch_thread):
    llm, runner = _runner(tiny_model_dir, dtype, **SCHEMES[scheme])  # Qwen2: qkv has a bias
    assert runner.native_decode is not None and runner.native_decode.quantized
    _check(runner, dtype, all_quantized=scheme != "ffn-int4")


def _refinish(lin, dtype: torch.dtype, bits: int, group: int, perm: torch.Tensor | None = None) -> None:
    """Turn a dense linear layer into a pre-quantized one (as GGUF/AWQ/GPTQ load them): its weight
    quantized to `bits`-bit group codes, in the input order `perm` where given (GPTQ act-order)."""
    w = lin.weight.data.float()
    del lin.weight
    if perm is not None:
        w = w[:, perm]
    codes, scales, zeros = K.quantize_groupwise(w, group, bits)
    method = GroupCodesLinearMethod("gguf", bits, group, act_order=perm is not None)
    method.dtype = dtype
    finish_group_codes(lin, codes, scales, zeros, bits=bits, dtype=dtype, perm=perm)
    lin.quant_method = method


@pytest.mark.parametrize("dtype", [BF16, "float32"])
def test_group_code_layouts_input_order_and_dense_layers_mixed(dtype, tiny_model_dir, one_torch_thread):
    """4-bit codes with an act-order input order, 8-bit group codes (GGUF Q5/Q6/Q8's layout), 4-bit
    codes in groups of 64 and dense layers, each linear layer on its own."""
    llm, runner = _runner(tiny_model_dir, dtype)
    model, tdt = runner.model, getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.layers):
        a, mlp = layer.self_attn, layer.mlp
        _refinish(a.qkv_proj, tdt, 4, 32, torch.randperm(a.qkv_proj.in_features, generator=g))
        _refinish(mlp.gate_up_proj, tdt, 8, 32)
        if i == 0:
            _refinish(mlp.down_proj, tdt, 4, 64)  # o_proj, and layer 1's down_proj, stay dense
    assert model.layers[0].mlp.gate_up_proj.kernel == "int8_group"
    runner.native_decode = NativeDecode.create(model, runner.kv_caches, runner.dtype, runner.kv_dtype,
                                               runner.block_size, None)
    assert runner.native_decode is not None and runner.native_decode.quantized
    _check(runner, dtype, all_quantized=False)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_awq_gptq_folders_run_the_fused_step(method, tmp_path, one_torch_thread):
    pytest.importorskip("auto_round_extension.torch.qlinear_torch_zp")
    from test_quantized_checkpoints import _quantized_pair

    qdir, _ = _quantized_pair(tmp_path, method)
    llm, runner = _runner(qdir, STEP_DTYPE)
    assert runner.native_decode is not None and runner.native_decode.quantized
    _check(runner, STEP_DTYPE, all_quantized=True, rows_list=(1, 5))


@pytest.mark.parametrize("dtype", [BF16, "float32"])
def test_greedy_generation_is_the_same_with_and_without_the_fused_step(dtype, tiny_model_dir, one_torch_thread):
    llm, runner = _runner(tiny_model_dir, dtype, **SCHEMES["int4"])
    prompts = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (3, 17, 40, 9, 33)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (30, 12, 25, 40, 8)]
    fused = llm.generate(prompts, params, use_tqdm=False)
    nd, runner.native_decode = runner.native_decode, None
    plain = llm.generate(prompts, params, use_tqdm=False)
    runner.native_decode = nd
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("dtype", [BF16, "float32"])
def test_int8_lm_head_gives_the_torch_heads_logits(dtype, tiny_llama_dir, one_torch_thread):
    """An LM head kept as int8 codes (a GGUF whose output tensor is quantized) runs the same kernel
    function in the fused step's head as in the torch path's LMHead: the same logits to the bit."""
    llm, runner = _runner(tiny_llama_dir, dtype, **SCHEMES["int4"])
    head = runner.model.lm_head
    head.keep_codes()
    w = head.weight.float()
    hidden = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(head.weight.dtype)
    with torch.inference_mode():
        y = head(hidden)
    assert y.dtype == torch.float32
    # int8 codes per 32 inputs: half a step per weight (|w| max / 254 of its block), plus the kernel's
    # bf16 and int8-activation rounding (test_quant_native)
    step = w.abs().reshape(w.shape[0], -1, 32).amax(-1).repeat_interleave(32, 1) / 127
    x = hidden.float()
    bound = x.abs() @ (step / 2).T + 2.0**-7 * (x.abs() @ w.abs().T) + _int8_act_bound(x, w.abs() * 1.01, 3)
    if dtype == "bfloat16":
        bound = bound + 2.0**-8 * (x @ w.T).abs()
    assert ((y - x @ w.T).abs() <= bound + 1e-4).all()
    runner.native_decode = nd = NativeDecode.create(runner.model, runner.kv_caches, runner.dtype, runner.kv_dtype,
                                                    runner.block_size, None)
    assert nd.has_head and nd.model.lm_head_q
    for rows, sample in ((1, [0]), (4, [3, 0, 1])):
        batch = _decode_batch(runner, [7 + 23 * i % 70 for i in range(rows)], seed=10 + rows)
        ref, logits, tokens = head_three_ways(runner, nd, batch, sample)
        assert torch.equal(logits, ref)
        assert tokens.tolist() == ref.argmax(dim=-1).tolist()


def test_default_gguf_keeps_its_q8_0_output_tensor_as_int8(monkeypatch, one_torch_thread):
    """The default model's GGUF stores the tied token_embd as Q8_0: every scheme on it runs the LM
    head from int8 codes (in the fused head too), unless PAGEDLLM_QUANT_LM_HEAD=0."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.models.loader.quantized import quantization_setup

    for method in ("gguf", "int4"):
        mc = EngineArgs(quantization=method).create_engine_config().model_config
        assert quantization_setup(mc).lm_head_int8
    monkeypatch.setenv("PAGEDLLM_QUANT_LM_HEAD", "0")
    assert not quantization_setup(mc).lm_head_int8
    monkeypatch.delenv("PAGEDLLM_QUANT_LM_HEAD")
    llm = LLM(quantization="gguf", dtype=STEP_DTYPE, max_model_len=64, num_kv_blocks=16, block_size=16)
    runner = llm.llm_engine.core.executor.runner
    head = runner.model.lm_head
    assert head.quant_codes is not None and head.qcodes.shape == (49152, 576)
    assert runner.native_decode.model.lm_head_q
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_w8a8_default_model_layers_and_fused_step(one_torch_thread):
    """The default model under w8a8 (STEP_DTYPE): every linear layer's decode-row calls (the native
    kernel) give torch's w8a8 result to the bit on the model's own weights and activations, and the
    fused step (the same kernel, per-token activation mode) equals the torch path to the bit."""
    from pagedllm.quantization.methods import W8A8LinearMethod

    llm = LLM(quantization="w8a8", dtype=STEP_DTYPE, max_model_len=128, num_kv_blocks=32, block_size=16)
    runner = llm.llm_engine.core.executor.runner
    nd = runner.native_decode
    assert nd is not None and nd.quantized
    linears = [m for m in runner.model.modules() if isinstance(getattr(m, "quant_method", None), W8A8LinearMethod)]
    assert len(linears) == 4 * len(runner.model.layers) and all(m.native for m in linears)
    calls: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((mod, args[0].clone(), out.clone())))
             for m in linears]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    runner.native_decode = None
    plain = llm.generate(["The capital of France is"], params, use_tqdm=False)
    for h in hooks:
        h.remove()
    assert len(calls) == 3 * len(linears)  # the prompt (6 rows) and two decode steps: all on the kernel
    for mod, x, y in calls:
        assert x.reshape(-1, x.shape[-1]).shape[0] <= 16
        ref = K.int8_dynamic_linear(x, mod.qweight.t(), mod.wscale)
        assert torch.equal(y, ref if mod.bias is None else ref + mod.bias)
    runner.native_decode = nd
    fused = llm.generate(["The capital of France is"], params, use_tqdm=False)
    assert fused[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    if STEP_DTYPE == "bfloat16":
        _check(runner, STEP_DTYPE, all_quantized=True, rows_list=(1, 4))
    # float32 (CPUs without a bf16 GEMM kernel): the two paths' norms and attention differ in float32
    # ulps, and on this model one ulp of a w8a8 layer's input can move the step's output by tens of
    # percent (a row's scale follows its largest activation, so one code step weighs much): the
    # torch path against itself, with every w8a8 input scaled by 1 + 2^-23, differs by up to 84 % of
    # a row's norm on _check's batches. The layers' bits and the tokens above are the comparison.


@pytest.mark.parametrize("preset", ["FP8_BLOCK", "W8A8", "W4A16_ASYM"])
def test_compressed_tensors_folders_run_the_fused_step(preset, tmp_path, one_torch_thread):
    """e4m3 codes with 32 x 32 block scales, a checkpoint's own w8a8 codes, asymmetric 4-bit groups."""
    pytest.importorskip("compressed_tensors")
    from test_compressed_checkpoints import _compressed_pair

    qdir, _ = _compressed_pair(tmp_path, preset, group_size=32 if preset == "W4A16_ASYM" else None,
                               block=[32, 32] if preset == "FP8_BLOCK" else None)
    llm, runner = _runner(qdir, STEP_DTYPE)
    assert runner.native_decode is not None and runner.native_decode.quantized
    _check(runner, STEP_DTYPE, all_quantized=True, rows_list=(1, 5))


def test_a_quantized_model_counts_its_weights_as_the_float_one(tiny_llama_dir):  # noqa: F811 (the fixture)
    """The start-up log's parameter count and the FLOPs per token (preemption's cost model) count a
    quantized linear layer's weights as the matrix its codes stand for, not as its packed buffers."""
    from pagedllm.worker.model_runner import parameter_count

    _, dense = _runner(tiny_llama_dir, "float32")
    _, q = _runner(tiny_llama_dir, "float32", quantization="int4", quantization_group_size=32)
    assert parameter_count(dense.model) == sum(p.numel() for p in dense.model.parameters())
    assert parameter_count(q.model) == parameter_count(dense.model)
    assert sum(p.numel() for p in q.model.parameters()) < parameter_count(dense.model)  # codes are buffers
    assert q.flops_per_token() == dense.flops_per_token() > 0
