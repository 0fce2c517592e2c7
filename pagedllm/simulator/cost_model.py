"""Step time of a simulated worker: GEMMs, attention, fixed overhead, block moves, communication.

    t = overhead + gemm + attention_prefill + attention_decode + moves + comm, where
    overhead  = step_overhead_s + per_seq_s * seqs + per_sample_s * sampled
                + prompt_step_s if the step computes any prompt token
    gemm      = max(tokens * 2N / tp / gemm_flops, weight_bytes / tp / weight_read_bw)
                + sampled * 2 * hidden * vocab / tp / gemm_flops          (lm_head rows)
    A step of at most small_step_tokens tokens (a profile's small-M kernel limit; 0: none) takes
    small_step_gemm_flops for its tokens and small_prompt_step_s for prompt_step_s.
    prefill   = pairs * 4 * layers * heads * head_dim / tp / attn_flops
                (a chunk of q tokens after c computed ones reads q*c + q(q+1)/2 pairs)
    decode    = context_tokens * kv_bytes_per_token / tp / kv_read_bw
    moves     = swapped_blocks * block_bytes / tp / swap_bw + copied_blocks * block_bytes / tp / copy_bw
    comm (TP) = layers * 2 all-reduces of tokens*hidden*dtype bytes:
                each latency + 2 (tp-1)/tp * bytes / link_bw                (ring)
    comm (PP) = (pp-1) sends of tokens*hidden*dtype bytes: latency + bytes / link_bw

Pipeline parallelism: the scheduler keeps one step in flight, so the stages run one after the
other; PP adds memory (KV capacity), not step speed. Each device holds 1/(tp*pp) of the weights
and of every KV block.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.simulator.hardware import HardwareProfile
from pagedllm.simulator.model import SimModel


@dataclass
class StepFeatures:
    """What a step computes, from its SchedulerOutput and the worker's request state."""

    num_tokens: int = 0
    num_seqs: int = 0
    num_sampled: int = 0
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    """(query, key) pairs of prompt chunks: q*c + q(q+1)/2 per chunk of q after c computed."""
    decode_tokens: int = 0
    decode_context: int = 0
    """Tokens whose K/V decode rows read: c + 1 per decode row with c computed."""
    swap_blocks: int = 0
    copy_blocks: int = 0

    def as_row(self) -> list[float]:
        """The step's measured features as calibration stores them: [1, tokens, prefill pairs, decode
        context, sequences, sampled rows, 1 if any prompt token]; calibrate.design makes the fit's
        regressors from them."""
        return [1.0, self.num_tokens, self.prefill_pairs, self.decode_context, self.num_seqs, self.num_sampled,
                1.0 if self.prefill_tokens else 0.0]


@dataclass
class StepCost:
    total: float
    overhead: float
    gemm: float
    prefill_attention: float
    decode_attention: float
    moves: float
    comm: float


class CostModel:
    def __init__(self, model: SimModel, hw: HardwareProfile, block_size: int, tp: int = 1, pp: int = 1) -> None:
        if tp < 1 or pp < 1:
            raise ValueError(f"tensor and pipeline parallel sizes must be at least 1, got tp={tp} pp={pp}")
        if model.shape.heads % tp or model.shape.kv_heads % tp and tp % model.shape.kv_heads:
            raise ValueError(f"tp={tp} does not divide heads={model.shape.heads} / kv_heads={model.shape.kv_heads}")
        if pp > model.shape.layers:
            raise ValueError(f"pp={pp} exceeds the model's {model.shape.layers} layers")
        self.model, self.hw, self.tp, self.pp = model, hw, tp, pp
        self.block_bytes = model.kv_bytes_per_token * block_size
        self.act_bytes_per_token = model.shape.hidden * model.dtype_bytes
        # Per-unit costs (seconds), precomputed: the simulator calls step_time once per step.
        self.s_token = model.flops_per_token / tp / hw.gemm_flops
        self.s_token_small = model.flops_per_token / tp / (hw.small_step_gemm_flops or hw.gemm_flops)
        self.s_weights = model.weight_bytes / tp / hw.weight_read_bw if hw.weight_read_bw else 0.0
        self.s_sample = model.lm_head_flops / tp / hw.gemm_flops + hw.per_sample_s
        self.s_pair = model.attention_flops_per_pair / tp / hw.attn_flops if hw.attn_flops else 0.0
        # Decode reads K/V of the context; with GQA the heads a device holds share them.
        kv_tp = min(tp, model.shape.kv_heads)
        self.s_ctx = model.kv_bytes_per_token / kv_tp / hw.kv_read_bw if hw.kv_read_bw else 0.0
        self.s_swap = self.block_bytes / kv_tp / hw.swap_bw
        self.s_copy = self.block_bytes / kv_tp / hw.copy_bw

    def comm_time(self, num_tokens: int) -> float:
        hw, tp, pp = self.hw, self.tp, self.pp
        if (tp == 1 and pp == 1) or num_tokens == 0:
            return 0.0
        if not hw.link_bw > 0:
            raise ValueError(f"profile {hw.name!r} has no link_bw: it cannot model tp={tp} / pp={pp}")
        msg = num_tokens * self.act_bytes_per_token
        t = 0.0
        if tp > 1:
            t += 2 * self.model.shape.layers * (hw.link_latency_s + 2 * (tp - 1) / tp * msg / hw.link_bw)
        if pp > 1:
            t += (pp - 1) * (hw.link_latency_s + msg / hw.link_bw)
        return t

    def step_time(self, f: StepFeatures) -> StepCost:
        hw = self.hw
        small = 0 < f.num_tokens <= hw.small_step_tokens
        overhead = hw.step_overhead_s + hw.per_seq_s * f.num_seqs
        if f.prefill_tokens:
            overhead += hw.small_prompt_step_s if small else hw.prompt_step_s
        gemm = 0.0
        if f.num_tokens:
            s_token = self.s_token_small if small else self.s_token
            gemm = max(f.num_tokens * s_token, self.s_weights) + f.num_sampled * self.s_sample
        prefill = f.prefill_pairs * self.s_pair
        decode = f.decode_context * self.s_ctx
        moves = f.swap_blocks * self.s_swap + f.copy_blocks * self.s_copy
        comm = self.comm_time(f.num_tokens)
        total = overhead + gemm + prefill + decode + moves + comm
        return StepCost(total, overhead, gemm, prefill, decode, moves, comm)

    def step_seconds(self, f: StepFeatures) -> float:
        return self.step_time(f).total
