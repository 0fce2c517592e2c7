"""BERT-family encoders: bidirectional attention over the whole prompt, absolute position and token
type embeddings, post-LN layers with GELU; `BertModel` for embeddings, `BertForSequenceClassification`
(BERT's pooler and a linear classifier on the CLS state) for cross-encoder scores.

An encoder keeps no KV cache: the engine runs each prompt whole in one step (it is never chunked),
so a sequence's tokens are all in the step's flat batch and the model finds each sequence where
its positions restart at 0. Token types: a position after the sequence's first [SEP] is type 1,
which is exactly how a BERT tokenizer types a text pair ([CLS] a [SEP] b [SEP]); a single text
has one [SEP], at its end, and is type 0 throughout.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.encoder import encoder_attention, encoder_attention_runs
from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.layers.linear import Linear, QKVLinear, fused_linear
from pagedllm.models.weights import check_complete, load_tensor

# hidden_act -> fused_linear's post-op name
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}


def _check_supported(config, parallel: ParallelContext, quant_config) -> None:
    if parallel.tp.size > 1 or parallel.pp_size > 1:
        raise ValueError("BERT encoders run on one rank: use tensor_parallel_size=1 and pipeline_parallel_size=1")
    if quant_config is not None:
        raise ValueError("BERT encoders run in the model dtype: drop --quantization")
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type={config.position_embedding_type!r} is not supported (absolute)")
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)})")


class _Segments:
    """The step's sequences: each one's first row and length in the flat tokens (int64), whether the
    native kernel attends (`native`: pagedllm.attention.encoder), and, for torch's attention
    (`padded`), a padded index [B, L] into the flat tokens, which padded slots are real, and the key
    mask."""

    def __init__(self, positions: torch.Tensor, native: bool) -> None:
        self.native = native
        T = positions.shape[0]
        starts = torch.nonzero(positions == 0).flatten()
        ends = torch.cat([starts[1:], starts.new_tensor([T])])
        self.lens = ends - starts
        self.single = len(starts) == 1
        self.starts = starts

    @cached_property
    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index [B, L], valid [B, L], key_mask [B, 1, 1, L])."""
        L = int(self.lens.max())
        offs = torch.arange(L, device=self.starts.device)
        valid = offs[None, :] < self.lens[:, None]
        index = torch.where(valid, self.starts[:, None] + offs[None, :], 0)
        return index, valid, valid[:, None, None, :]


class BertLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.head_dim = heads, h // heads
        eps = config.layer_norm_eps
        self.qkv = QKVLinear(h, self.head_dim, heads, heads, True, dtype)
        self.attn_out = Linear(h, h, bias=True, dtype=dtype)
        self.attn_norm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.up = Linear(h, config.intermediate_size, bias=True, dtype=dtype)
        self.down = Linear(config.intermediate_size, h, bias=True, dtype=dtype)
        self.out_norm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.act = _ACTIVATIONS[config.hidden_act]

    def attention(self, x: torch.Tensor, seg: _Segments) -> torch.Tensor:
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        qkv = fused_linear(x, self.qkv.weight, self.qkv.bias)
        if seg.native:
            return encoder_attention(qkv, seg.starts, seg.lens, H, D, D ** -0.5)
        q, k, v = qkv.view(T, 3, H, D).unbind(1)
        if seg.single:  # one sequence: no padding
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            return o.transpose(0, 1).reshape(T, H * D)
        index, valid, key_mask = seg.padded
        q, k, v = (t[index].transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return o.transpose(1, 2)[valid].reshape(T, H * D)

    def forward(self, x: torch.Tensor, seg: _Segments) -> torch.Tensor:
        attn = self.attn_out
        x = self.attn_norm(fused_linear(self.attention(x, seg), attn.weight, attn.bias, residual=x))
        h = fused_linear(x, self.up.weight, self.up.bias, post=self.act)
        return self.out_norm(fused_linear(h, self.down.weight, self.down.bias, residual=x))


class BertModel(nn.Module):
    """The encoder; forward returns the last layer's hidden states [T, hidden]."""

    pooling_only = True
    prefix = ""  # checkpoint name prefix of the encoder's tensors

    def __init__(self, config, dtype: torch.dtype = torch.float32, parallel: ParallelContext | None = None,
                 quant_config=None) -> None:
        super().__init__()
        _check_supported(config, parallel or ParallelContext(), quant_config)
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h, dtype=dtype)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.sep_token_id = getattr(config, "sep_token_id", None)
        for p in self.parameters():
            p.requires_grad_(False)

    def token_types(self, input_ids: torch.Tensor, seg: _Segments) -> torch.Tensor:
        """1 after the sequence's first [SEP], else 0 (see the module docstring)."""
        if self.sep_token_id is None or self.config.type_vocab_size < 2:
            return torch.zeros_like(input_ids)
        sep = (input_ids == self.sep_token_id).to(torch.int64)
        before = torch.cumsum(sep, 0) - sep  # [SEP]s before each position, over the whole batch
        seq = torch.cumsum(torch.zeros_like(input_ids).index_fill_(0, seg.starts, 1), 0) - 1
        return (before - before[seg.starts][seq] > 0).to(torch.int64)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        seg = _Segments(positions, encoder_attention_runs(self.embed_norm.weight.dtype, self.layers[0].head_dim,
                                                          input_ids.device))
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(self.token_types(input_ids, seg)))
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, seg)
        return x

    # ---- weights ---------------------------------------------------------------------------
    _NAMES = {
        "embeddings.word_embeddings.": "word_embeddings.",
        "embeddings.position_embeddings.": "position_embeddings.",
        "embeddings.token_type_embeddings.": "token_type_embeddings.",
        "embeddings.LayerNorm.": "embed_norm.",
    }
    _LAYER_NAMES = {
        "attention.output.dense.": "attn_out.",
        "attention.output.LayerNorm.": "attn_norm.",
        "intermediate.dense.": "up.",
        "output.dense.": "down.",
        "output.LayerNorm.": "out_norm.",
    }
    _QKV = {"attention.self.query.": "q", "attention.self.key.": "k", "attention.self.value.": "v"}

    def map_name(self, name: str) -> tuple[str, object] | None:
        """(parameter name, q/k/v shard) of checkpoint tensor `name`; None for one pagedllm does
        not use (position_ids buffers, BERT's pooler in an embedding model)."""
        name = name.removeprefix(self.prefix)
        for frag, new in self._NAMES.items():
            if name.startswith(frag):
                return new + name[len(frag):], None
        if name.startswith("encoder.layer."):
            _, _, idx, rest = name.split(".", 3)
            for frag, shard in self._QKV.items():
                if rest.startswith(frag):
                    return f"layers.{idx}.qkv.{rest[len(frag):]}", shard
            for frag, new in self._LAYER_NAMES.items():
                if rest.startswith(frag):
                    return f"layers.{idx}.{new}{rest[len(frag):]}", None
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            mapped = self.map_name(ckpt_name)
            if mapped is None:
                continue
            name, shard = mapped
            load_tensor(params, name, shard, ckpt_name, tensor, type(self).__name__)
            loaded.add(name)
        check_complete(params, loaded)
        return loaded


class BertForSequenceClassification(BertModel):
    """A cross-encoder: the encoder, BERT's pooler (dense + tanh on the CLS state) and a classifier."""

    prefix = "bert."

    def __init__(self, config, dtype: torch.dtype = torch.float32, parallel: ParallelContext | None = None,
                 quant_config=None) -> None:
        super().__init__(config, dtype, parallel, quant_config)
        h = config.hidden_size
        self.pooler = Linear(h, h, bias=True, dtype=dtype)
        self.classifier = Linear(h, config.num_labels, bias=True, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] CLS states -> [N, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler(cls_hidden)))

    def map_name(self, name: str) -> tuple[str, object] | None:
        if name.startswith("classifier."):
            return name, None
        if name.startswith(self.prefix + "pooler.dense."):
            return "pooler." + name[len(self.prefix + "pooler.dense."):], None
        return super().map_name(name)
