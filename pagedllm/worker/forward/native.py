"""Small decode-only steps as one native call (worker/native_decode.py), on one CPU rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedllm.worker.forward.base import ForwardPath, PreparedStep
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.native_decode import NativeDecode
from pagedllm.worker.sample import sampler_fault_hook


class NativeDecodePath(ForwardPath):
    """The decoder stack of a decode-only step the fused call takes (NativeDecode.applies), ending
    at the final norm. A step the kernel declines (the KV cache then untouched) runs on `fallback`."""

    name = "native_decode"

    def __init__(self, nd: NativeDecode, fallback: ForwardPath) -> None:
        self.nd = nd
        self.fallback = fallback

    def applies(self, step: PreparedStep) -> bool:
        b = step.batch if step.token_rows is None else step.token_rows
        return self.nd.applies(len(b.input_ids), len(b.seq_lens), bool(b.dense))

    def run(self, step: PreparedStep) -> torch.Tensor:
        b = step.batch if step.token_rows is None else step.token_rows
        hidden = self.nd.run(b.input_ids, b.positions, b.slot_mapping, b.block_tables, b.seq_lens, step.lora_slots,
                             b.kv_groups)
        return self.fallback.run(step) if hidden is None else hidden


class NativeHeadPath(ForwardPath):
    """A step the native decode path takes, run on through the LM head in the same call: the
    sampled rows' token ids when they all sample greedily with no logits processing and no
    logprobs (the sampler would take the argmax of the same logits), else their logits.

    Where the native decode path applies, it applies to steps with no forked samples and no
    prompt logprobs (both need hidden states) whose sampled rows are few enough that the torch
    path's LM head is the same GEMM. In a step of decodes and speculative verifications every
    token's row is sampled (a verifying request's 1 + k positions each give the target's token or
    logits there), so its proposals are checked against the argmax of the same call. A step the kernel declines runs on `fallback` (the native
    decode path) and then the torch LM head, which gives the same logits."""

    name = "native_head"
    head = True

    def __init__(self, nd: NativeDecode, fallback: ForwardPath, input_batch: InputBatch,
                 sampling_metadata: Callable[[np.ndarray, int], Any], model: torch.nn.Module,
                 device: torch.device) -> None:
        self.nd = nd
        self.fallback = fallback
        self.input_batch = input_batch
        self.sampling_metadata = sampling_metadata
        self.model = model
        self.device = device

    def applies(self, step: PreparedStep) -> bool:
        """Given that the native decode path applies to the step."""
        b = step.batch if step.token_rows is None else step.token_rows
        return (not step.so.forked_reqs and self.nd.head_applies(len(b.sample_rows))
                and not (self.input_batch.prompt_logprobs[step.rows] >= 0).any())

    def run(self, step: PreparedStep) -> np.ndarray | torch.Tensor:
        """The head's output for the step's sampled rows; in a step of decodes and verifications
        (step.token_rows), for every token's row, indexed as the step's flat rows."""
        b = step.batch
        rows = b if step.token_rows is None else step.token_rows
        greedy = False
        if sampler_fault_hook() is None:
            try:
                md = self.sampling_metadata(step.rows[b.sample_req_indices], self.nd.vocab)
            except Exception:  # the sampler reports it (and fails the row) from the logits
                md = None
            greedy = md is not None and md.argmax_only and (step.token_rows is None or self._min_tokens_met(step))
        mask = mask_rows = None
        so = step.so
        if so.grammar_bitmask is not None:  # structured output: the kernel masks before its argmax
            mask = so.grammar_bitmask
            row_req = b.sample_req_indices if step.token_rows is None else np.repeat(np.arange(len(step.req_ids)),
                                                                                      step.counts)
            mask_rows = np.asarray([so.structured_rows.get(step.req_ids[j], -1) for j in row_req], dtype=np.int64)
        out = self.nd.run_head(rows.input_ids, rows.positions, rows.slot_mapping, rows.block_tables, rows.seq_lens,
                               rows.sample_rows, greedy, mask, mask_rows, step.lora_slots, rows.kv_groups)
        if out is not None:
            step.grammar_masked = mask is not None
            return out
        hidden = self.fallback.run(step)
        return self.model.compute_logits(hidden[torch.from_numpy(rows.sample_rows).to(self.device, non_blocking=True)])

    def _min_tokens_met(self, step: PreparedStep) -> bool:
        """Whether every request of a verification step has its min_tokens before its proposals
        (which the batch counts among its tokens until the step is done): then none of its
        positions blocks a token, and their argmax is what verification compares with."""
        ib = self.input_batch
        proposed = np.fromiter((len(step.so.spec_token_ids.get(r, ())) for r in step.req_ids), dtype=np.int64,
                               count=len(step.req_ids))
        out = ib.num_tokens[step.rows] - ib.num_prompt_tokens[step.rows] - proposed
        return bool((out >= ib.min_tokens[step.rows]).all())
