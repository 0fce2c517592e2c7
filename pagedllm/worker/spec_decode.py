"""Speculative decoding's worker side: verifying proposed tokens against the target model.

A speculating request is scheduled for 1 + k tokens: its last token and k proposals
(SchedulerOutput.spec_token_ids). The forward pass computes them like any prompt chunk, so its
last k + 1 rows hold the target's logits after the last token and after each proposal. For each
request, position j's distribution p_j is the one the sampler would draw from there, with every
sampling parameter applied (logit bias, allowed tokens, min_tokens, penalties over the tokens
before it including the proposals before j, temperature, top-k, top-p, min-p); then:

- greedy: proposal j is accepted while it is p_j's argmax; the first rejected one is replaced by
  the argmax, and when all k are accepted the argmax after the last one is added (the bonus);
- random: proposal x_j is accepted with probability p_j(x_j) (a point-mass draft: the n-gram
  proposer's q is 1 at x_j); the first rejected one is replaced by a draw from p_j with x_j
  removed and renormalised, and when all are accepted a draw from p_k is added. Each emitted token
  is then distributed exactly as p_j (accepted with p_j(x), else drawn from the rest in
  proportion), so the target's distribution is kept whatever the proposals.

A seeded request draws its k + 1 uniforms from its own generator, so it repeats itself run to run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.scheduler_output import Logprobs, SchedulerOutput
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.sample import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_min_p,
    apply_top_k_top_p,
    compute_topk_logprobs,
    pick_from_probs,
    row_argmax,
)

logger = logging.getLogger(__name__)


@dataclass
class SpecRows:
    """The step's speculating requests that sample: where each sits and what it proposed."""

    out_pos: list[int]
    """Index of each request in the step's output."""
    slots: np.ndarray
    """Each request's row in the persistent batch."""
    proposals: list[list[int]]
    """Each request's proposed tokens (k_i of them)."""
    flat_rows: np.ndarray
    """The flat batch rows of their logits: k_i + 1 per request, in order."""

    @property
    def offsets(self) -> list[int]:
        """Start of each request's rows in flat_rows."""
        out, acc = [], 0
        for p in self.proposals:
            out.append(acc)
            acc += len(p) + 1
        return out


def alone_rows(so: SchedulerOutput) -> int:
    """The fewest rows of x from which a speculating step's bf16 GEMMs may run on AMX tiles
    (layers/native_linear.amx_rows_from): past this step's rows when it is one request's last
    token and its proposals, 0 (the default) otherwise. Without speculation a single stream
    decodes one row per step, in the AVX-512 BF16 form, and the tiles sum in another order; a
    verification of its 1 + k rows in that form gives each row the bits it has alone, so greedy
    outputs are those of speculation off. Steps of several requests (or a prompt chunk) take the
    tiles as they do without speculation. The cost: a verification of 5 or more rows runs slower
    in that form than on the tiles (docs/speculative.md)."""
    if len(so.num_scheduled_tokens) != 1 or not verifies_only(so):
        return 0
    return next(iter(so.num_scheduled_tokens.values())) + 1


def verifies_only(so: SchedulerOutput) -> bool:
    """Whether the step verifies proposals and holds nothing else: every request runs its last token
    and its proposals (if any). Then every token attends over the cache alone, as a decode of its
    own (one token a work item of the native attention kernel, or a row of the fused decode step:
    input_batch.token_rows), in the form and order of sums that token takes decoded without
    proposals; a tile of several query tokens sums its scores in another order (the kernel's
    transposed tiles, paged_attention.c), which parts greedy outputs from speculation off in
    bfloat16."""
    spec = so.spec_token_ids
    return bool(spec) and all(n == 1 + len(spec.get(rid, ())) for rid, n in so.num_scheduled_tokens.items())


def split_spec_rows(spec: dict[str, list[int]], req_ids: list[str], rows: np.ndarray, sample_req: np.ndarray,
                    sample_rows: np.ndarray) -> tuple[SpecRows | None, np.ndarray]:
    """The speculating requests among the step's sampling ones, and the mask of the others."""
    is_spec = np.fromiter((req_ids[j] in spec for j in sample_req), dtype=bool, count=len(sample_req))
    if not is_spec.any():
        return None, ~is_spec
    idx = np.flatnonzero(is_spec)
    proposals = [spec[req_ids[sample_req[j]]] for j in idx]
    ks = np.asarray([len(p) for p in proposals], dtype=np.int64)
    last = sample_rows[idx]
    # Request i's rows: last - k_i .. last.
    flat = np.concatenate([np.arange(int(e) - int(k), int(e) + 1) for e, k in zip(last, ks)])
    return SpecRows(sample_req[idx].tolist(), rows[sample_req[idx]], proposals, flat), ~is_spec


def _position_rows(ib: InputBatch, spec: SpecRows) -> list[SamplingRow]:
    """One sampling row per verified position: the request's parameters and generator, with the
    proposals before that position counted among its outputs (penalties, min_tokens)."""
    out = []
    for slot, props in zip(spec.slots.tolist(), spec.proposals):
        base = ib.sampling_row(slot)
        for j in range(len(props) + 1):
            out.append(SamplingRow(base.params, base.generator, base.prompt_token_ids,
                                   base.output_token_ids + props[:j], base.eos_token_ids))
    return out


def _plain_greedy(ib: InputBatch, slots: np.ndarray) -> bool:
    """Whether every request samples the argmax of its raw logits (no logits processing, no logprobs)."""
    out = ib.num_tokens[slots] - ib.num_prompt_tokens[slots]
    return bool(
        ib.greedy[slots].all() and not ib.has_token_rules[slots].any() and (ib.logprobs[slots] < 0).all()
        and (ib.repetition_penalty[slots] == 1.0).all() and not ib.presence_penalty[slots].any()
        and not ib.frequency_penalty[slots].any() and (out >= ib.min_tokens[slots]).all())


def target_probs(processed: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Each row's sampling distribution [S, V] from its processed logits: temperature, top-k,
    top-p, min-p, renormalised; a greedy row's is a point mass on its argmax."""
    x = processed if md.temperature is None else processed / md.temperature.unsqueeze(1)
    if md.top_k is not None or md.top_p is not None:
        x = apply_top_k_top_p(x, md.top_k, md.top_p)
    probs = x.softmax(dim=-1)
    if md.min_p is not None:
        probs = apply_min_p(probs, md.min_p)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if md.all_greedy or md.greedy_mask is not None:
        one_hot = torch.zeros_like(probs).scatter_(1, row_argmax(processed).unsqueeze(1), 1.0)
        probs = one_hot if md.all_greedy else torch.where(md.greedy_mask.unsqueeze(1), one_hot, probs)
    return probs


def _uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> list[float]:
    u = torch.empty(n, dtype=torch.float64, device=device)
    u.uniform_(generator=generator) if generator is not None else u.uniform_()
    return u.tolist()


def verify(sampler: Sampler, logits: torch.Tensor, ib: InputBatch, spec: SpecRows,
           device: torch.device) -> list[list[int]]:
    """The tokens each speculating request keeps: its accepted proposals, then one of the target's."""
    offsets = spec.offsets
    if _plain_greedy(ib, spec.slots):
        target = row_argmax(logits.float()).tolist()
        return [_accept_greedy(props, target[o : o + len(props) + 1]) for props, o in zip(spec.proposals, offsets)]
    rows = _position_rows(ib, spec)
    md = SamplingMetadata.from_rows(rows, logits.shape[-1], device)
    processed = sampler.process_logits(logits, md)
    if md.all_greedy:
        target = row_argmax(processed).tolist()
        return [_accept_greedy(props, target[o : o + len(props) + 1]) for props, o in zip(spec.proposals, offsets)]
    probs = target_probs(processed, md)
    flat_props = [t for props in spec.proposals for t in (*props, 0)]  # 0: the bonus position's placeholder
    p_prop = probs.gather(1, torch.tensor(flat_props, device=device).unsqueeze(1)).squeeze(1).tolist()
    kept: list[list[int]] = []
    final_rows, final_u = [], []
    for props, o in zip(spec.proposals, offsets):
        k = len(props)
        u = _uniforms(k + 1, rows[o].generator, device)
        a = 0
        while a < k and u[a] < p_prop[o + a]:
            a += 1
        kept.append(list(props[:a]))
        final_rows.append(o + a)
        final_u.append(u[k])
    dist = probs[torch.tensor(final_rows, device=device)]
    rejected = [(i, props[len(kept[i])]) for i, props in enumerate(spec.proposals) if len(kept[i]) < len(props)]
    if rejected:  # the rejected proposal's probability moves to the rest of the row
        dist[[i for i, _ in rejected], [t for _, t in rejected]] = 0.0
    final = pick_from_probs(dist, torch.tensor(final_u, dtype=torch.float64, device=device).unsqueeze(1))
    for tokens, t in zip(kept, final.tolist()):
        tokens.append(t)
    return kept


def verify_greedy_tokens(spec: SpecRows, target: np.ndarray) -> list[list[int]]:
    """Greedy verification from the target's argmax at each verified position (`target`, in
    flat_rows' order), as the fused decode step's head gives it."""
    t = target.tolist()
    return [_accept_greedy(props, t[o : o + len(props) + 1]) for props, o in zip(spec.proposals, spec.offsets)]


def _accept_greedy(props: list[int], target: list[int]) -> list[int]:
    a = 0
    while a < len(props) and props[a] == target[a]:
        a += 1
    return [*props[:a], target[a]]


def verify_isolating_faults(sampler: Sampler, logits: torch.Tensor, ib: InputBatch, spec: SpecRows,
                            device: torch.device) -> tuple[list[list[int] | None], dict[int, str]]:
    """verify(); when it raises, each request alone, failing only those that raise on their own
    (index into spec -> error). An error no single request explains is re-raised."""
    try:
        return list(verify(sampler, logits, ib, spec, device)), {}
    except Exception as batch_error:
        error = batch_error
    offsets = spec.offsets
    out: list[list[int] | None] = []
    failed: dict[int, str] = {}
    for i, (props, o) in enumerate(zip(spec.proposals, offsets)):
        one = SpecRows([spec.out_pos[i]], spec.slots[i : i + 1], [props], spec.flat_rows[o : o + len(props) + 1])
        try:
            out.append(verify(sampler, logits[o : o + len(props) + 1], ib, one, device)[0])
        except Exception as e:
            out.append(None)
            failed[i] = f"{type(e).__name__}: {e}"
    if not failed:
        raise error
    logger.error("verifying proposals failed for %d of %d requests: %s", len(failed), len(out),
                 "; ".join(failed.values()))
    return out, failed


def accepted_logprobs(logits: torch.Tensor, spec: SpecRows, kept: list[list[int] | None], ib: InputBatch,
                      ) -> dict[int, Logprobs]:
    """Logprobs (from the raw logits) of each kept token of the requests that ask for them."""
    out: dict[int, Logprobs] = {}
    for i, (o, tokens) in enumerate(zip(spec.offsets, kept)):
        k = int(ib.logprobs[spec.slots[i]])
        if tokens is None or k < 0:
            continue
        ids, lps, ranks = compute_topk_logprobs(logits[o : o + len(tokens)],
                                                torch.tensor(tokens, device=logits.device), k)
        out[i] = Logprobs(token_ids=ids.tolist(), logprobs=lps.tolist(), ranks=ranks.tolist())
    return out


def verify_step(model: torch.nn.Module, sampler: Sampler, ib: InputBatch, spec: SpecRows, hidden: torch.Tensor | None,
                head: torch.Tensor | np.ndarray | None, device: torch.device, is_driver: bool,
                ) -> tuple[list[list[int] | None], dict[int, str], dict[int, Logprobs]] | None:
    """A step's verification: (tokens each speculating request keeps, None where it failed; errors
    and logprobs by index into spec), None on a rank that does not sample. From the head path's
    output over every flat row where the step took it (`head`: argmax token ids, or logits), else
    from the LM head over `hidden` at the verified positions."""
    if isinstance(head, np.ndarray):  # argmax only: no logprobs, nothing to fail on
        return list(verify_greedy_tokens(spec, head[spec.flat_rows])), {}, {}
    if head is not None:
        logits = head[torch.from_numpy(spec.flat_rows)]
    else:
        assert hidden is not None, "a step with proposals runs a path that returns hidden states"
        logits = model.compute_logits(hidden[torch.from_numpy(spec.flat_rows).to(device)])
    if not is_driver:
        return None
    kept, errors = verify_isolating_faults(sampler, logits, ib, spec, device)
    return kept, errors, accepted_logprobs(logits, spec, kept, ib)
