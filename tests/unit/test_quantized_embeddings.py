"""--quantize-embeddings: the token embedding and the LM head kept as codes of the native kernel.

The embedding's lookup expands the rows it gathers with the same per-row code as the batch path's
expansion (linear_quant.c's dequant_row), so gathered rows equal the expanded weight's rows to the
bit; the LM head runs the quantized linear kernels, checked against the float weight with a bound
derived from each scheme's rounding; the fused decode step reads the same codes with the same C
functions, so in bfloat16 it equals the torch path to the bit (test_native_decode_quant.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import QuantizationConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.quantization import native
from pagedllm.quantization.native import load_quant_kernel
from pagedllm.quantization.vocab import quantize_rows, rows_from_group_codes
from pagedllm.worker.native_decode import load_decode_kernel
from test_native_decode import head_three_ways, tiny_llama_dir  # noqa: F401 (a fixture)
from test_native_decode_quant import STEP_DTYPE, _check, _decode_batch
from test_quant_native import _bound, _int8_act_bound

pytestmark = pytest.mark.skipif(
    load_decode_kernel() is None or load_quant_kernel() is None or not load_decode_kernel().small_m_available() & 1,
    reason="no C compiler, or neither AVX-512 BF16 nor AVX2 + FMA")

SCHEMES = ("int8", "int4", "fp8")


def _weight_error(w: torch.Tensor, scheme: str, group: int) -> torch.Tensor:
    """A bound of |expanded code - w| per weight, from the scheme's rounding: half a step of the
    code, and the bfloat16 rounding (relative 2^-8) of the scales and zeros the kernel keeps."""
    n, k = w.shape
    if scheme == "int8":  # symmetric, step amax / 127 per 32 inputs
        s = (w.abs().reshape(n, -1, 32).amax(-1) / 127).repeat_interleave(32, 1)
        return s / 2 + 2.0**-8 * (w.abs() + s / 2)
    if scheme == "int4":  # asymmetric, step (max - min) / 15 per group; the kernel's zero is min + 8 step
        g = w.reshape(n, -1, group)
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15).repeat_interleave(group, 1)
        z = (lo + 8 * (hi - lo) / 15).abs().repeat_interleave(group, 1)
        return s / 2 + 2.0**-8 * (8 * s + z)
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormals 2^-9 apart, per-row scale amax / 448
    s = w.abs().amax(1, keepdim=True) / 448
    return w.abs() * (2.0**-4 + 2.0**-8) + s * 2.0**-10


@pytest.mark.parametrize("scheme", SCHEMES)
def test_embedding_rows_are_the_expanded_codes_and_the_head_meets_the_float_weight(scheme):
    g = torch.Generator().manual_seed(len(scheme))
    vocab, hidden = 203, 256  # 203 rows: a partial tile of 16
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    rc = quantize_rows(w, scheme, group_size=64)
    err = _weight_error(w, scheme, rc.group)
    ids = torch.tensor([[0, 202, 17], [17, 5, 190]])
    for dtype in (torch.float32, torch.bfloat16):
        emb = VocabEmbedding(vocab, hidden, dtype, None)
        emb.weight.data.copy_(w)
        emb.use_codes(rc)
        assert not emb.dense and "weight" not in dict(emb.named_parameters())
        full = native.dequantize(*rc.tensors(), rc.bits, vocab, dtype)
        rows = emb(ids)
        assert rows.dtype == dtype and rows.shape == (2, 3, hidden)
        assert torch.equal(rows, full[ids])  # only the gathered rows expanded, bit for bit
    full = native.dequantize(*rc.tensors(), rc.bits, vocab, torch.float32)
    assert ((full - w).abs() <= err).all()

    head = LMHead(vocab, hidden, torch.float32, None)
    head.use_codes(rc)
    mag = w.abs() + err
    for m in (1, 5, native.SMALL_M + 4):  # the kernel's rows, and the batch path
        x = torch.randn(m, hidden, generator=g)
        y = head(x)
        assert y.dtype == torch.float32 and y.shape == (m, vocab)
        bound = x.abs() @ err.T + _bound(x, mag) + _int8_act_bound(x, mag * (1 + 2.0**-8), m)
        assert ((y - x @ w.T).abs() <= bound).all(), m


def test_tied_embedding_and_head_share_one_set_of_codes(tiny_llama_dir, one_torch_thread):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=32, block_size=16, quantization="int8",
              quantize_embeddings=True)
    model = llm.llm_engine.core.executor.runner.model
    emb, head = model.embed_tokens, model.lm_head
    assert not emb.dense and not head.dense
    for a, b in zip(emb.quant_codes[2:], head.quant_codes[2:]):
        assert a is b
    # No dense vocab matrix anywhere: every float tensor of the model is small.
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    vocab, hidden = emb.rows, emb.qcodes.shape[1]
    assert not [t for t in tensors if t.is_floating_point() and t.numel() >= vocab * hidden // 2]
    # The codes are counted once: int8 per row + a bf16 scale and zero per 32 inputs.
    codes_bytes = sum(t.numel() * t.element_size() for t in emb.quant_codes[2:])
    assert codes_bytes == -(-vocab // 16) * 16 * hidden * (1 + 4 / 32)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_step_reads_the_quantized_embedding_as_the_torch_path(scheme, tiny_model_dir, one_torch_thread):
    """Untied (Qwen2): the embedding and the head quantized separately; bfloat16: the same bits."""
    llm = LLM(model=tiny_model_dir, dtype=STEP_DTYPE, num_kv_blocks=64, block_size=16, quantization=scheme,
              quantization_group_size=32, quantize_embeddings=True)
    runner = llm.llm_engine.core.executor.runner
    nd = runner.native_decode
    assert nd is not None and nd.model.embed_q and nd.has_head and nd.model.lm_head_q
    assert runner.model.embed_tokens.qcodes is not runner.model.lm_head.qcodes
    _check(runner, STEP_DTYPE, all_quantized=True, rows_list=(1, 6))
    batch = _decode_batch(runner, [9, 40, 23], seed=4)
    ref, logits, tokens = head_three_ways(runner, nd, batch, [2, 0])
    assert torch.equal(logits, ref)
    assert tokens.tolist() == ref.argmax(dim=-1).tolist()


def test_the_flag_needs_a_quantization_that_takes_it():
    with pytest.raises(ValueError, match="quantize_embeddings=True needs a quantization"):
        EngineArgs(quantize_embeddings=True).create_engine_config()
    with pytest.raises(ValueError, match="not 'awq'"):
        QuantizationConfig(method="awq", embeddings=True)
    # the LM head's codes beside its dense weight (a quantized speculative draft's): the same schemes,
    # and not on top of embeddings kept as codes alone
    with pytest.raises(ValueError, match="lm_head codes apply.*not 'awq'"):
        QuantizationConfig(method="awq", lm_head=True)
    with pytest.raises(ValueError, match="lm_head codes apply.*embeddings=True"):
        QuantizationConfig(method="int8", embeddings=True, lm_head=True)


def test_gguf_keeps_the_files_q8_0_embedding_blocks(one_torch_thread):
    """The default model's tied token_embd is Q8_0: its blocks become the int8 codes per 32 inputs
    (the same codes and bf16 scales as quantizing the expanded weight), and every step, the fused
    one included, reads them."""
    from pagedllm.models.loader import read_gguf_header, resolve_model
    from pagedllm.models.loader.gguf_weights import dequantize_gguf

    llm = LLM(quantization="gguf", quantize_embeddings=True, dtype=STEP_DTYPE, max_model_len=64, num_kv_blocks=16,
              block_size=16)
    runner = llm.llm_engine.core.executor.runner
    emb = runner.model.embed_tokens
    header = read_gguf_header(resolve_model(None).path)
    info = header.tensors["token_embd.weight"]
    raw = np.memmap(header.path, dtype=np.uint8, mode="r")[info.offset: info.offset + info.n_bytes]
    rc = quantize_rows(dequantize_gguf(raw, info.qtype, info.torch_shape), "int8")
    assert emb.quant_codes[:2] == (8, 32) and emb.qcodes is runner.model.lm_head.qcodes
    assert torch.equal(emb.qcodes, rc.codes) and torch.equal(emb.qscales, rc.scales)
    assert runner.native_decode.model.embed_q and runner.native_decode.model.lm_head_q
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("bits", [4, 6])
def test_stored_group_codes_keep_their_values(bits):
    """A GGUF vocabulary tensor's blocks (4-bit types as 4-bit codes, 5 to 8 bits as centred int8
    codes) expand to code * scale + zero, the zero as the kernel keeps it (zero + offset * scale in
    bfloat16)."""
    g = torch.Generator().manual_seed(bits)
    n, k, group = 45, 128, 32
    codes = torch.randint(0, 1 << bits, (n, k), generator=g).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=g).bfloat16().float()
    zeros = torch.randn(n, k // group, generator=g).bfloat16().float()
    rc = rows_from_group_codes(codes, scales, zeros, bits)
    assert (rc.bits, rc.group) == (4 if bits == 4 else 8, group)
    shift = 8 if bits == 4 else 1 << (bits - 1)
    kz = (zeros + shift * scales).bfloat16().float()
    ref = ((codes.float() - shift).reshape(n, -1, group) * scales[..., None] + kz[..., None]).reshape(n, k)
    torch.testing.assert_close(native.dequantize(*rc.tensors(), rc.bits, n, torch.float32), ref, rtol=2**-20, atol=0)
