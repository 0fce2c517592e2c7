"""The encoders' attention kernel (encoder_attention.c) against torch's SDPA on each sequence alone
(computed in float64), against itself (a sequence's rows are the same bits alone or beside others),
and BERT's forward with the kernel against its torch path; fused_linear against torch's ops.

Tolerances. float32: the kernel's scores are D-term float32 sums, its exp a degree-6 2^x (relative
error < 2e-7) and its sums over at most 80 keys float32: each output is within about 1e-6 of the
float64 reference for the O(1) inputs here; 2e-5 absolute leaves room for any order of the sums and
still catches a wrong key, row or head. bf16: the kernel widens the inputs exactly and computes in
float32, then rounds the output once to bf16 (half an ulp, 2^-9 relative): 2^-8 of max|v| bounds it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention import encoder as enc
from pagedllm.attention.encoder import encoder_attention, encoder_attention_runs
from pagedllm.layers.linear import fused_linear

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not encoder_attention_runs(torch.float32, 32, CPU),
                                reason="the encoder attention kernel is not built here")


def _reference(qkv: torch.Tensor, lens: list[int], H: int, D: int) -> torch.Tensor:
    out, s = [], 0
    for n in lens:
        q, k, v = qkv[s:s + n].double().view(n, 3, H, D).permute(1, 2, 0, 3)
        out.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, H * D))
        s += n
    return torch.cat(out)


def _segments(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    lens_t = torch.tensor(lens, dtype=torch.int64)
    return torch.cumsum(lens_t, 0) - lens_t, lens_t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,D", [(12, 32), (4, 64)])
def test_matches_sdpa_per_sequence(dtype: torch.dtype, H: int, D: int) -> None:
    if not encoder_attention_runs(dtype, D, CPU):
        pytest.skip(f"no {dtype} kernel here")
    torch.manual_seed(H * D)
    lens = [1, 3, 15, 16, 17, 40, 63, 80]  # one row; under, at and past a 16-key vector and a 4-row block
    qkv = torch.randn(sum(lens), 3 * H * D).to(dtype)
    starts, lens_t = _segments(lens)
    out = encoder_attention(qkv, starts, lens_t, H, D, D ** -0.5)
    ref = _reference(qkv, lens, H, D)
    assert out.dtype == dtype and out.shape == (sum(lens), H * D)
    tol = 2e-5 if dtype == torch.float32 else 2**-8 * qkv.float().abs().max().item()
    assert (out.double() - ref).abs().max().item() < tol


def test_a_sequence_is_the_same_alone_or_beside_others() -> None:
    torch.manual_seed(0)
    H, D, lens = 12, 32, [7, 33, 50, 2]
    qkv = torch.randn(sum(lens), 3 * H * D)
    starts, lens_t = _segments(lens)
    together = encoder_attention(qkv, starts, lens_t, H, D, D ** -0.5)
    s = 0
    for n in lens:
        alone = encoder_attention(qkv[s:s + n].clone(), torch.tensor([0]), torch.tensor([n]), H, D, D ** -0.5)
        assert torch.equal(alone, together[s:s + n])
        s += n


def test_reads_a_strided_view_in_place() -> None:
    """A QKV tensor whose rows are wider than 3 H D (a view of a wider projection) is read in place."""
    torch.manual_seed(1)
    H, D, lens = 2, 16, [5, 9]
    wide = torch.randn(sum(lens), 3 * H * D + 16)
    starts, lens_t = _segments(lens)
    out = encoder_attention(wide[:, : 3 * H * D], starts, lens_t, H, D, D ** -0.5)
    assert torch.equal(out, encoder_attention(wide[:, : 3 * H * D].contiguous(), starts, lens_t, H, D, D ** -0.5))


def test_bert_forward_native_against_torch_path(monkeypatch) -> None:
    from transformers import BertConfig

    from pagedllm.models.bert import BertModel

    torch.manual_seed(2)
    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, sep_token_id=3)
    model = BertModel(config)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    lens = [5, 20, 1, 33]
    ids = torch.randint(4, 100, (sum(lens),))
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        native = model(ids, positions)
        monkeypatch.setattr("pagedllm.models.bert.encoder_attention_runs", lambda *a: False)
        eager = model(ids, positions)
    assert (native - eager).abs().max().item() < 1e-4  # float32, two layers of O(1) LayerNorm outputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("post", [None, "gelu", "gelu_tanh", "relu", "residual"])
def test_fused_linear_matches_torch(dtype: torch.dtype, post: str | None) -> None:
    torch.manual_seed(3)
    rows = 40  # past MKLDNN_MIN_ROWS: the oneDNN call where the CPU runs the dtype
    x, w, b = torch.randn(rows, 96).to(dtype), (torch.randn(80, 96) * 0.1).to(dtype), torch.randn(80).to(dtype)
    res = torch.randn(rows, 80).to(dtype)
    y = fused_linear(x, w, b, residual=res) if post == "residual" else fused_linear(x, w, b, post=post)
    lin = x.double() @ w.double().T + b.double()
    ref = {None: lin, "gelu": F.gelu(lin), "gelu_tanh": F.gelu(lin, approximate="tanh"), "relu": F.relu(lin),
           "residual": lin + res.double()}[post]
    # float32: 96-term sums of O(0.3) products, ~1e-6; bf16: one rounding of the output (and, on
    # CPUs where the GEMM is torch's, of the GEMM before the activation): 2^-7 of the largest value.
    tol = 1e-4 if dtype == torch.float32 else 2**-7 * ref.abs().max().item()
    assert y.dtype == dtype and (y.double() - ref).abs().max().item() < tol


def test_fused_linear_takes_one_of_post_and_residual() -> None:
    x = torch.randn(20, 8)
    with pytest.raises(ValueError, match="'gelu'"):
        fused_linear(x, torch.randn(4, 8), None, post="gelu", residual=torch.randn(20, 4))


def test_kernel_declines_head_sizes_off_16() -> None:
    assert not encoder_attention_runs(torch.float32, 24, CPU)
    assert enc._FUNCTIONS.keys() == {torch.float32, torch.bfloat16}
