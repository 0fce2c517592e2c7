"""The sampling algorithms, batched over rows: penalties, top-k / top-p / min-p cuts and draws.

`sample_random_rows` is the sampler's draw for random rows: temperature, then top-k, top-p and
min-p, then one inverse-CDF draw per row (`pick_from_probs`) with a uniform number the row draws
from its own generator when seeded (`draw_uniforms`). Each row's way through it depends on its own
settings and logits alone, so that a seeded row draws the same tokens in any batch.
"""

from __future__ import annotations

import torch

from pagedllm.worker.native_decode import argmax_rows
from pagedllm.worker.sample.kernel import sample_rows_native, top_p_cuts, top_p_cuts_apply
from pagedllm.worker.sample.metadata import PenaltyMetadata

_NEG_INF = float("-inf")
# Top-k (and top-p beside it) find each row's cut among its TOP_CANDIDATES largest logits (one
# torch.topk); a row whose cut lies beyond them takes the native kernel's top-p cut, or where that
# does not run a sort of its whole row. A full sort of the vocabulary costs about 2 ms a row here
# (49,152 tokens), a topk of 256 about 0.1 ms.
TOP_CANDIDATES = 256


def select_rows(t: torch.Tensor | None, rows: slice | torch.Tensor) -> torch.Tensor | None:
    """t[rows], or None where t is None (a part of the metadata no row uses)."""
    return None if t is None else t[rows]


def sample_random_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Random rows' tokens (see Sampler._sample_random), each drawn with its uniform number u [S, 1].

    Each row takes one of three ways, chosen from its own settings and logits alone, so that a
    seeded row draws the same tokens in any batch:
    - no top-k and no top-p: its whole row;
    - top-p without top-k, where the native kernel runs: the whole draw in one native call
      (`sample_rows_native`: its row cut at top_p in one pass whatever the size of the nucleus, a
      model unsure of its next token spreading 0.95 of its mass over thousands of tokens);
    - otherwise its largest logits (`top_candidates`) when its cut lies among them, else its whole
      row cut by `apply_top_k_top_p`.
    """
    S, V = logits.shape
    none = torch.zeros(S, dtype=torch.bool, device=logits.device)
    k_on = none if top_k is None else top_k < V
    p_on = none if top_p is None else top_p < 1.0
    native = bool(p_on.any()) and top_p_cuts_apply(logits)
    ways = (~k_on & ~p_on, ~k_on & p_on if native else none)
    ways = (*ways, ~(ways[0] | ways[1]))
    tokens = torch.empty(S, dtype=torch.int64, device=logits.device)
    for way, rows_mask in enumerate(ways):
        if not bool(rows_mask.any()):
            continue
        every = bool(rows_mask.all())
        rows = slice(None) if every else rows_mask.nonzero().squeeze(1)
        x, t, mp, ur = (logits, temperature, min_p, u) if every else (
            logits[rows], temperature[rows], select_rows(min_p, rows), u[rows])
        if way == 1 and (drawn := sample_rows_native(x, t, top_p[rows], mp, ur)) is not None:
            tokens[rows] = drawn
            continue
        x = x / t.unsqueeze(1)
        if way == 0:
            tokens[rows] = pick_from_probs(_truncated_probs(x, mp), ur)
        else:  # way 2, or way 1 where the native call could not run
            tokens[rows] = _sample_candidates(x, select_rows(top_k, rows), select_rows(top_p, rows), mp, ur)
    return tokens


def _sample_candidates(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                       min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Rows drawn from their largest logits where their cut lies among them, else from their whole
    row cut by apply_top_k_top_p."""
    vals, ids, inside = top_candidates(logits, top_k, top_p)
    if bool(inside.all()):
        return ids.gather(1, pick_from_probs(_truncated_probs(vals, min_p), u).unsqueeze(1)).squeeze(1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for rows, in_candidates in ((inside.nonzero().squeeze(1), True), ((~inside).nonzero().squeeze(1), False)):
        if rows.numel() == 0:
            continue
        if in_candidates:
            picked = pick_from_probs(_truncated_probs(vals[rows], select_rows(min_p, rows)), u[rows])
            tokens[rows] = ids[rows].gather(1, picked.unsqueeze(1)).squeeze(1)
        else:
            cut = apply_top_k_top_p(logits[rows], select_rows(top_k, rows), select_rows(top_p, rows))
            tokens[rows] = pick_from_probs(_truncated_probs(cut, select_rows(min_p, rows)), u[rows])
    return tokens


def _truncated_probs(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """softmax of each row (-inf logits: probability 0), then min-p."""
    probs = logits.softmax(dim=-1)
    return probs if min_p is None else apply_min_p(probs, min_p)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of [S, V] (torch.argmax's answer): on the CPU one native pass per row,
    where torch's reduction runs scalar (pagedllm/worker/native_decode.py `argmax_rows`)."""
    ids = argmax_rows(x)
    return x.argmax(dim=-1) if ids is None else ids


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] float32 count of each token per row, ignoring the pad id V.

    token_ids [[2, 2, 0], [1, 3, 3]] with V = 3 (3 is padding) -> [[1, 0, 2], [0, 1, 0]]:
    the pad lands in an extra column V that is cut off.
    """
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, p: PenaltyMetadata) -> torch.Tensor:
    """Repetition (prompt or output tokens), then frequency and presence (output tokens) penalties."""
    vocab_size = logits.shape[1]
    output_counts = _token_counts(p.output_token_ids, vocab_size)
    output_seen = output_counts > 0
    if p.prompt_token_ids is not None:
        seen = output_seen | (_token_counts(p.prompt_token_ids, vocab_size) > 0)
        rep = p.repetition_penalties.unsqueeze(1)
        # Shrinks seen tokens' logits toward 0 from either side: 2.0 -> 2.0 / rep, -2.0 -> -2.0 * rep.
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - p.frequency_penalties.unsqueeze(1) * output_counts
    return logits - p.presence_penalties.unsqueeze(1) * output_seen


def top_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's largest logits and its top-k / top-p cut among them.

    A row's candidates are its k + 1 largest logits with a top-k, at least TOP_CANDIDATES of them
    with a top-p: a number set by the row alone, so that whether its cut lies among them does not
    depend on the other rows of the batch. Returns (vals, ids, inside): the batch's largest logits
    in descending order [S, C] (C the most any row needs), -inf below each row's cut, their token
    ids [S, C], and whether the row keeps nothing outside its own candidates [S] (its cut is above
    the last of them, or they are the whole vocabulary). A row that is not inside keeps tokens
    beyond them (no cut, a nucleus wider than they are, or ties with the cut outside them):
    `apply_top_k_top_p` on its whole row. The cut is apply_top_k_top_p's: top-k keeps the k largest
    logits and ties with the k-th; top-p the smallest run of largest logits whose probability after
    top-k reaches top_p, and ties with the last of them.
    """
    S, V = logits.shape
    none = torch.zeros(S, dtype=torch.bool, device=logits.device)
    k_on = none if top_k is None else top_k < V  # rows with a top-k (k = V: off)
    p_on = none if top_p is None else top_p < 1.0
    # One candidate past k: a top-k cut above it keeps nothing outside the candidates.
    own = (torch.where(k_on, top_k + 1, 1) if top_k is not None
           else torch.ones(S, dtype=torch.int64, device=logits.device))
    own = torch.where(p_on, own.clamp(min=TOP_CANDIDATES), own).clamp(max=V)
    kc = int(own.max())
    vals, ids = logits.topk(kc, dim=-1)  # descending
    cut = torch.full((S, 1), _NEG_INF, device=logits.device)
    if top_k is not None:
        cut = _kth(vals, top_k, k_on)
        vals = vals.masked_fill(vals < cut, _NEG_INF)
    if top_p is not None:
        # Probabilities of the candidates under the row's softmax after top-k (over the candidates for
        # top-k rows, whose kept tokens they hold when the row is inside), their running sum in
        # descending order, and the first position where it reaches top_p: the last token kept.
        lse = vals.logsumexp(dim=-1, keepdim=True)
        if not bool(k_on.all()):
            lse = torch.where(k_on.unsqueeze(1), lse, logits.logsumexp(dim=-1, keepdim=True))
        last = ((vals - lse).exp().cumsum(dim=-1) < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)
        p_cut = vals.gather(1, last.clamp(max=kc - 1)).masked_fill(~p_on.unsqueeze(1), _NEG_INF)
        # A nucleus past the row's own candidates: no cut among them (the row is not inside).
        p_cut = p_cut.masked_fill((last >= own.unsqueeze(1)) & p_on.unsqueeze(1), float("nan"))
        cut = torch.maximum(cut, p_cut)  # NaN stays NaN
        vals = vals.masked_fill(vals < cut, _NEG_INF)
    # The row's last candidate, masked above when below the cut (equal to it: ties may lie outside).
    last_own = vals.gather(1, (own - 1).unsqueeze(1)).squeeze(1)
    inside = (cut.squeeze(1) > last_own) | (own >= V)
    return vals, ids, inside


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    top-k keeps the k largest logits and every logit equal to the k-th (never fewer than k). top-p
    keeps the smallest run of largest logits whose probability (after top-k) reaches top_p, and
    every logit equal to the last of them; a row always keeps its largest logit, and rows with top_p
    1.0 keep everything. top-k: the k-th of torch.topk. top-p: the native kernel's cut
    (`top_p_cuts`, one pass a row), or where it does not run a sort of each whole row
    (`_top_k_top_p_sorted`). The sampler calls it for the rows whose cut its candidates do not hold.
    """
    V = logits.shape[1]
    if top_k is not None and bool((k_on := top_k < V).any()):
        vals = logits.topk(int(top_k[k_on].max()), dim=-1).values
        logits = logits.masked_fill(logits < _kth(vals, top_k, k_on), _NEG_INF)
    if top_p is None:
        return logits
    cut = top_p_cuts(logits, top_p)
    return _top_k_top_p_sorted(logits, None, top_p) if cut is None else logits.masked_fill(logits < cut, _NEG_INF)


def _kth(vals: torch.Tensor, top_k: torch.Tensor, k_on: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest logit [S, 1] from its largest ones in descending order, vals [S, C]
    (C at least every k of the rows in k_on), -inf where top-k is off. Column k - 1 holds it:
    top_k [2, 5] -> columns [1, 4]."""
    return vals.gather(1, (top_k.clamp(max=vals.shape[1]) - 1).unsqueeze(1)).masked_fill(~k_on.unsqueeze(1), _NEG_INF)


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """apply_top_k_top_p by sorting every row whole (where the native cut does not run)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each sorted position: probs [0.5, 0.3, 0.2] -> [0.0, 0.5, 0.8]. With top_p 0.8
        # the third token goes (0.8 already reached), the first two stay; column 0 (mass 0.0) always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p 1.0 keep everything, even if rounding pushes the running sum to 1.0 early.
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        # Ties with the last token kept stay, as in the candidates' path.
        cut = sorted_logits.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cut, _NEG_INF)
    # Undo the sort: sorted position j of row r came from column order[r, j].
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes probabilities below min_p times the row's largest one (rows need not be renormalized)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def draw_uniforms(rows: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) per row [rows, 1] (float64): unseeded rows in one batched call
    from the default generator, then each seeded row its own from its generator, so that its samples
    depend neither on the other rows nor on its position in the batch."""
    u = torch.empty(rows, 1, dtype=torch.float64, device=device)
    if len(generators) < rows:
        u.uniform_()
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    return u


def pick_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column of each row of `probs` ([S, C], rows need not sum to 1) drawn by inverse CDF with the
    row's uniform u [S, 1]: the first column whose running sum exceeds u times the row's total, so
    a column of probability 0 is never drawn. One running sum a row, not a random number per token:
    the exponential race (argmax(probs / q), q ~ Exp(1)) draws S * C numbers, 130 ms for 128 rows of
    49,152 here.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Below the total by at least one step of float32 (u * total may round up to it): the first
    # running sum above the target then always belongs to a column of non-zero probability.
    target = torch.minimum((u * total.double()).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    # A row with nothing to draw (all zero or NaN) gets its last column rather than one past the end.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
