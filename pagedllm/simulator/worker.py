"""The simulated worker: the model runner's side of the scheduler contract, without a model.

It keeps the same per-request state the real worker keeps (tokens, block table, computed count),
applies each SchedulerOutput the same way (forget finished and preempted requests, update cached
ones, learn new ones, fork samples), and returns the ModelRunnerOutput the real worker would: the
scheduled requests in batch order, then the forked ones, with one sampled token for each request
whose tokens are all computed after the step. It also says what the step computed
(StepFeatures) for the cost model. With `check`, it asserts the contract every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.simulator.cost_model import StepFeatures

# The token every simulated sample produces; requests run with ignore_eos, so it never stops one.
SAMPLED_TOKEN = 1


@dataclass
class _State:
    num_prompt: int
    num_tokens: int
    num_computed: int
    num_blocks: int


class SimWorker:
    def __init__(self, block_size: int, check: bool = False) -> None:
        self.block_size = block_size
        self.check = check
        self.reqs: dict[str, _State] = {}

    def _apply(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        reqs = self.reqs
        for d in so.cached_reqs:
            st = reqs[d.req_id]
            if self.check:
                assert d.num_computed_tokens == st.num_computed, (
                    f"{d.req_id}: scheduler says {d.num_computed_tokens} computed, worker has {st.num_computed}")
            st.num_blocks += len(d.new_block_ids)
        for d in so.new_reqs:
            if self.check:
                assert d.req_id not in reqs, f"{d.req_id} sent as new while the worker holds it"
            n = len(d.prompt_token_ids) + len(d.output_token_ids)
            reqs[d.req_id] = _State(len(d.prompt_token_ids), n, d.num_computed_tokens, len(d.block_ids))
        if self.check:
            order = [d.req_id for d in so.cached_reqs] + [d.req_id for d in so.new_reqs]
            assert list(so.num_scheduled_tokens) == order, "batch order is not cached then new"
            dsts = [d for _, d in so.blocks_to_swap_in] + [d for _, d in so.blocks_to_copy]
            assert len(dsts) == len(set(dsts)), "a device block is written twice in one step"

    def execute_model(self, so: SchedulerOutput) -> tuple[ModelRunnerOutput, StepFeatures]:
        self._apply(so)
        f = StepFeatures(swap_blocks=len(so.blocks_to_swap_out) + len(so.blocks_to_swap_in),
                         copy_blocks=len(so.blocks_to_copy))
        reqs, bs, check = self.reqs, self.block_size, self.check
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        tokens = seqs = n_sampled = pre_tok = pairs = dec_tok = ctx = 0
        for rid, n in so.num_scheduled_tokens.items():
            st = reqs[rid]
            c = st.num_computed
            if check:
                assert n >= 1 and c + n <= st.num_tokens, f"{rid}: {n} tokens after {c} of {st.num_tokens}"
                assert st.num_blocks * bs >= c + n, f"{rid}: {st.num_blocks} blocks for {c + n} tokens"
            tokens += n
            seqs += 1
            if n == 1 and c >= st.num_prompt:
                dec_tok += 1
                ctx += c + 1
            else:
                pre_tok += n
                pairs += n * c + n * (n + 1) // 2
            c += n
            st.num_computed = c
            if c == st.num_tokens:
                st.num_tokens += 1
                n_sampled += 1
                sampled.append([SAMPLED_TOKEN])
            else:
                sampled.append([])
        for fk in so.forked_reqs:
            parent = reqs[fk.parent_id]
            if check:
                assert parent.num_computed == parent.num_tokens - 1, f"{fk.req_id} forked off an unfinished prompt"
            reqs[fk.req_id] = _State(parent.num_prompt, parent.num_tokens, parent.num_computed, len(fk.block_ids))
            req_ids.append(fk.req_id)
            sampled.append([SAMPLED_TOKEN])
            n_sampled += 1
        f.num_tokens, f.num_seqs, f.num_sampled = tokens, seqs, n_sampled
        f.prefill_tokens, f.prefill_pairs, f.decode_tokens, f.decode_context = pre_tok, pairs, dec_tok, ctx
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled), f
