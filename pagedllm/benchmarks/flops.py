"""Model FLOPs of a Llama-family decoder, from its config alone (no weights, no torch).

Per request with P prompt tokens and O output tokens the model runs T = P + O - 1 tokens through
its layers (the last sampled token is never fed back) and computes O rows of logits:

    FLOPs = 2 * N * T                          dense layers (N = decoder parameters, no embeddings)
          + 2 * hidden * vocab * O             lm_head, once per sampled token
          + 4 * layers * heads * head_dim * T * (T + 1) / 2
                                               attention: QK^T and PV, token t attends to t tokens

2 FLOPs per multiply-add. The embedding lookup and elementwise work (norms, rotary, SiLU,
softmax) are left out, as is usual for MFU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelShape:
        heads = int(cfg.num_attention_heads)
        return cls(
            hidden=int(cfg.hidden_size),
            intermediate=int(cfg.intermediate_size),
            layers=int(cfg.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            vocab=int(cfg.vocab_size),
            tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        )

    @property
    def decoder_params(self) -> int:
        """N: q, k, v, o projections, gate/up/down MLP and the two norms per layer, plus the final norm."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h
        return self.layers * per_layer + h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        return self.decoder_params + self.embedding_params * (1 if self.tied else 2)

    def decode_weight_bytes(self, itemsize: int = 4) -> int:
        """Weights one decode step must read: every decoder weight and the lm_head matrix (the
        embedding table contributes one row per token, which is negligible)."""
        return (self.decoder_params + self.embedding_params) * itemsize

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize

    def request_flops(self, prompt_len: int, output_len: int) -> float:
        t = prompt_len + output_len - 1
        dense = 2 * self.decoder_params * t
        lm_head = 2 * self.hidden * self.vocab * output_len
        attention = 4 * self.layers * self.heads * self.head_dim * t * (t + 1) / 2
        return float(dense + lm_head + attention)

    def token_flops(self, context_len: int) -> float:
        """FLOPs of one decode step of one sequence whose new token attends to `context_len` tokens."""
        return float(2 * self.decoder_params + 2 * self.hidden * self.vocab
                     + 4 * self.layers * self.heads * self.head_dim * context_len)

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of a whole prompt in one pass, with the logits of its last position."""
        return self.request_flops(prompt_len, 1)


FORMULA = (
    "FLOPs per request = 2*N*T + 2*hidden*vocab*O + 4*layers*heads*head_dim*T*(T+1)/2, "
    "T = prompt + output - 1 tokens through the layers, O = output tokens, "
    "N = decoder parameters without embeddings and lm_head"
)
