"""Faults the tests inject into pagedllm through its hook points, to check that one request's
failure fails that request alone:

- a sampler fault (`pagedllm.worker.sample.metadata.fault_hook`): building the sampling metadata
  raises SamplingFaultInjected for a row whose request has a given seed once it has some output
  tokens, standing for a request whose sampling state breaks the sampler;
- a detokenizer fault (`pagedllm.engine.detokenizer.fault_hook`): decoding a given token id raises
  DetokenizerFaultInjected, standing for a detokenizer that fails on one request's output.

In-process tests set the hooks with monkeypatch; a server's processes get them from the launcher
tests/fault_serve.py.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.worker.sample.row import SamplingRow


class SamplingFaultInjected(RuntimeError):
    """Raised by the sampler fault."""


class DetokenizerFaultInjected(RuntimeError):
    """Raised by the detokenizer fault."""


def parse_sampler_fault(value: str | None) -> tuple[int, int] | None:
    """"7" -> (7, 0), "7:3" -> (7, 3), None or "" -> None."""
    if not value:
        return None
    seed, _, after = value.partition(":")
    try:
        return int(seed), int(after or 0)
    except ValueError:
        raise ValueError(f"sampler fault {value!r}: expected SEED or SEED:AFTER (integers)") from None


def sampler_fault(seed: int, after: int = 0) -> Callable[[list[SamplingRow]], None]:
    """The sampler's fault hook: raises for a row with this seed once it has `after` output tokens."""

    def hook(rows: list[SamplingRow]) -> None:
        for r in rows:
            if r.params.seed == seed and len(r.output_token_ids) >= after:
                raise SamplingFaultInjected(f"injected sampler fault (seed {seed}, {len(r.output_token_ids)} tokens)")

    return hook


def detokenizer_fault(token: int) -> Callable[[list[int]], None]:
    """The detokenizer's fault hook: raises when it is given this token id to decode."""

    def hook(token_ids: list[int]) -> None:
        if token in token_ids:
            raise DetokenizerFaultInjected(f"injected detokenizer fault (token {token})")

    return hook


def install(sampler: tuple[int, int] | None = None, detokenizer: int | None = None) -> None:
    """Sets the hooks in this process: the sampler fault (seed, after), the detokenizer fault's token."""
    from pagedllm.engine import detokenizer as detokenizer_module
    from pagedllm.worker.sample import metadata

    if sampler is not None:
        metadata.fault_hook = sampler_fault(*sampler)
    if detokenizer is not None:
        detokenizer_module.fault_hook = detokenizer_fault(detokenizer)
