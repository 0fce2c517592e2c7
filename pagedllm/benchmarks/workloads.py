"""Benchmark workloads: lists of (prompt token ids, output length), identical for every backend.

Token ids rather than text: every engine then sees exactly the same prompt lengths, with no
tokenizer round trip. Outputs are generated greedily with ignore_eos, so each request produces
exactly `output_len` tokens on every engine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class VocabInfo:
    """Which token ids a random prompt may use: [0, size) minus the special ones."""

    size: int
    special_ids: frozenset[int]


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'32:512' -> (32, 512), both ends inclusive; '64' -> (64, 64)."""
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"{name} must look like LOW:HIGH (e.g. 32:512) or N, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} needs 1 <= LOW <= HIGH, got {lo}:{hi}")
    return lo, hi


def _token_sampler(rng: random.Random, vocab: VocabInfo):
    usable = vocab.size - len([t for t in vocab.special_ids if 0 <= t < vocab.size])
    if usable < 1:
        raise ValueError(f"the vocabulary of {vocab.size} ids holds no non-special token")

    def draw(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(vocab.size)
            if t not in vocab.special_ids:
                out.append(t)
        return out

    return draw


def random_workload(num_prompts: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int],
                    vocab: VocabInfo, seed: int = 0) -> list[BenchRequest]:
    """Prompt and output lengths uniform in their inclusive ranges; random non-special token ids."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    rng = random.Random(seed)
    draw = _token_sampler(rng, vocab)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_len_range)
        n_out = rng.randint(*output_len_range)
        reqs.append(BenchRequest(draw(n_in), n_out))
    return reqs


def shared_prefix_workload(num_prompts: int, prefix_len: int, num_prefixes: int, suffix_len_range: tuple[int, int],
                           output_len_range: tuple[int, int], vocab: VocabInfo, seed: int = 0) -> list[BenchRequest]:
    """`num_prefixes` random prefixes of `prefix_len` tokens, shared round-robin by the prompts;
    each prompt appends its own random suffix (length uniform in `suffix_len_range`)."""
    if num_prompts < 1 or num_prefixes < 1 or prefix_len < 0:
        raise ValueError(
            f"shared-prefix needs num_prompts >= 1, num_prefixes >= 1 and prefix_len >= 0, "
            f"got {num_prompts}, {num_prefixes}, {prefix_len}"
        )
    rng = random.Random(seed)
    draw = _token_sampler(rng, vocab)
    prefixes = [draw(prefix_len) for _ in range(num_prefixes)]
    reqs = []
    for i in range(num_prompts):
        n_suffix = rng.randint(*suffix_len_range)
        n_out = rng.randint(*output_len_range)
        reqs.append(BenchRequest(prefixes[i % num_prefixes] + draw(n_suffix), n_out))
    return reqs


def load_dataset(path: str, num_prompts: int | None = None, vocab_size: int | None = None) -> list[BenchRequest]:
    """A JSON list of {"prompt_token_ids": [...], "output_len": N} ("max_tokens" also accepted)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"dataset file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"dataset file {path} is not readable JSON: {exc}") from None
    if isinstance(data, dict) and "requests" in data:
        data = data["requests"]
    if not isinstance(data, list) or not data:
        raise ValueError(f"dataset file {path} must hold a non-empty JSON list of requests")
    reqs = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"dataset {path}: entry {i} is not an object")
        ids = item.get("prompt_token_ids")
        n_out = item.get("output_len", item.get("max_tokens"))
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"dataset {path}: entry {i} needs a non-empty list of token ids in 'prompt_token_ids'")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise ValueError(f"dataset {path}: entry {i} has token id {max(ids)} >= vocab size {vocab_size}")
        if not isinstance(n_out, int) or n_out < 1:
            raise ValueError(f"dataset {path}: entry {i} needs a positive integer 'output_len', got {n_out!r}")
        reqs.append(BenchRequest(list(ids), n_out))
    return reqs[:num_prompts] if num_prompts else reqs


def dump_workload(reqs: Iterable[BenchRequest], path: str) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in reqs]), encoding="utf-8")


def workload_summary(reqs: list[BenchRequest]) -> dict[str, float | int]:
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    return {
        "num_requests": len(reqs),
        "prompt_tokens": sum(ins),
        "output_tokens": sum(outs),
        "mean_prompt_len": sum(ins) / len(ins),
        "mean_output_len": sum(outs) / len(outs),
        "max_prompt_len": max(ins),
        "max_output_len": max(outs),
    }


def vocab_info(model: str | None) -> VocabInfo:
    """Token ids usable in random prompts for `model` (ids below both the config's and the
    tokenizer's vocabulary size, minus the tokenizer's special tokens)."""
    from pagedllm.models.loader import load_hf_config, load_tokenizer, resolve_model

    source = resolve_model(model)
    tok = load_tokenizer(source)
    size = min(int(load_hf_config(source).vocab_size), len(tok))
    special = set(tok.all_special_ids)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tok, name, None)
        if isinstance(value, int):
            special.add(value)
    special.update(getattr(tok, "added_tokens_decoder", {}).keys())
    return VocabInfo(size, frozenset(special))
