"""An encoder step's bidirectional attention on the CPU (pagedllm/native/csrc/encoder_attention.c):
each sequence of the step attends over all of its own tokens, read in place from the step's flat QKV
projection, no padding. The torch form it replaces gathered the sequences into a padded [B, H, L, D]
batch and ran torch's SDPA under a key mask: for all-MiniLM-L6-v2's steps of about 50 sequences
(10-63 tokens, 1,900 in all) 7-8 ms a layer on 2 cores, float32 or bf16, against about 1 ms here
(see docs/embeddings.md). The kernel is built and bound by pagedllm.native; it is off with the flash
kernel's switch (PAGEDLLM_NATIVE_FLASH=0), and the caller runs torch's form where this returns None.
"""

from __future__ import annotations

import ctypes
import torch

from pagedllm import native
from pagedllm.native import kernels

_FUNCTIONS = {torch.float32: kernels.ENCODER_ATTENTION_F32.name, torch.bfloat16: kernels.ENCODER_ATTENTION_BF16.name}


def encoder_attention_runs(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether encoder_attention takes a step of this dtype, head size and device."""
    return (device.type == "cpu" and dtype in _FUNCTIONS and head_dim % 16 == 0
            and (lib := native.load(kernels.ENCODER_ATTENTION)) is not None and hasattr(lib, _FUNCTIONS[dtype]))


def encoder_attention(qkv: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, num_heads: int,
                      head_dim: int, scale: float) -> torch.Tensor:
    """Attention output [T, num_heads * head_dim] of qkv [T, 3 * num_heads * head_dim] (q, k, v of
    each token, heads in order), sequence i being rows starts[i] .. starts[i] + lens[i] - 1
    (int64 CPU tensors). Call only where encoder_attention_runs says so."""
    T = qkv.shape[0]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty(T, num_heads * head_dim, dtype=qkv.dtype)
    fn = getattr(native.load(kernels.ENCODER_ATTENTION), _FUNCTIONS[qkv.dtype])
    rc = fn(ctypes.c_void_p(qkv.data_ptr()), qkv.stride(0), ctypes.c_void_p(starts.data_ptr()),
            ctypes.c_void_p(lens.data_ptr()), len(starts), num_heads, head_dim, scale,
            ctypes.c_void_p(out.data_ptr()), out.stride(0))
    if rc != 0:
        raise MemoryError(f"encoder_attention could not allocate its buffers for {T} tokens (code {rc})")
    return out
