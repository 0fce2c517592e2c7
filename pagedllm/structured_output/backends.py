"""The grammar libraries behind one interface: xgrammar (the default) and llguidance.

A backend does three things. `check` compiles a request's structure without the tokenizer, in the
front end, so that a bad schema, regex or grammar is answered at once with an error naming it.
`compile` builds the tokenizer-bound grammar in the engine core (off the step loop; see
manager.py). A compiled grammar makes one `Matcher` per sequence, which accepts each sampled token
and fills its row of the step's token bitmask (int32 words, bit i of word j allowing token 32j+i,
the layout both libraries share); `fill` fills all of a step's rows of one backend in one call.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.schema import (
    check_schema,
    choice_grammar,
    load_schema,
    never_enforced,
    without_additional_properties,
    xgrammar_unsupported,
)


_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _first_line(e: BaseException) -> str:
    """A library's error message without its C++ source location ("[16:33:04] /x/y.cc:94: ")."""
    text = str(e).strip()
    return _LOCATION.sub("", text.splitlines()[0]) if text else type(e).__name__


def json_schema_of(sop: StructuredOutputsParams) -> dict[str, Any]:
    """The JSON schema a `json` or `json_object` request asks for, with its options applied."""
    schema = {"type": "object"} if sop.json_object else load_schema(sop.json)  # type: ignore[arg-type]
    if sop.disable_additional_properties:
        schema = without_additional_properties(schema)
    return schema


def validate_json_schema(sop: StructuredOutputsParams) -> dict[str, Any]:
    """The request's JSON schema, checked to be one and to use nothing no backend enforces."""
    schema = json_schema_of(sop)
    check_schema(schema)
    never = never_enforced(schema)
    if never:
        raise ValueError(f"the JSON schema uses {', '.join(never)}, which constrained decoding cannot enforce")
    return schema


class Matcher:
    """One sequence's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False when the grammar does not allow it."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """Whether the grammar has ended (its stop token accepted): the sequence is done."""
        raise NotImplementedError


class GrammarBackend:
    name = ""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids

    @classmethod
    def unsupported(cls, sop: StructuredOutputsParams) -> str | None:
        """Why this backend cannot enforce `sop` exactly (None when it can); tokenizer-free."""
        raise NotImplementedError

    @classmethod
    def check(cls, sop: StructuredOutputsParams) -> None:
        """Compiles `sop` without a tokenizer; ValueError naming the problem."""
        raise NotImplementedError

    def compile(self, sop: StructuredOutputsParams) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Matcher:
        raise NotImplementedError

    def fill(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Fills `bitmask[row]` for each (matcher, row)."""
        raise NotImplementedError


# ---- xgrammar ---------------------------------------------------------------------------------
class _XgrammarMatcher(Matcher):
    __slots__ = ("m",)

    def __init__(self, m: Any) -> None:
        self.m = m

    def accept(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())


def _structural_tag_args(text: str) -> tuple[Any, ...]:
    """vLLM's structural tag JSON: the `{"structures": [{"begin", "schema", "end"}], "triggers"}`
    form, or xgrammar's own (`{"type": "structural_tag", "format": {...}}`)."""
    import xgrammar as xgr

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("structural_tag must be a JSON object")
    if "structures" in spec:
        tags = []
        for i, s in enumerate(spec["structures"]):
            if not isinstance(s, dict) or not {"begin", "end"} <= set(s):
                raise ValueError(f"structural_tag.structures[{i}] needs begin, schema and end")
            tags.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]))
        triggers = spec.get("triggers")
        if not isinstance(triggers, list) or not triggers:
            raise ValueError("structural_tag.triggers must be a non-empty list of strings")
        return tags, triggers
    return (text,)


class XgrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
        self.tokenizer_info = info
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    @classmethod
    def unsupported(cls, sop: StructuredOutputsParams) -> str | None:
        if sop.whitespace_pattern is not None:
            return "whitespace_pattern"
        if sop.json is not None or sop.json_object:
            bad = xgrammar_unsupported(json_schema_of(sop))
            if bad:
                return "the JSON schema keyword(s) " + ", ".join(bad)
        return None

    @classmethod
    def check(cls, sop: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        kind = sop.kind
        try:
            if kind in ("json", "json_object"):
                schema = validate_json_schema(sop)
                xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=not sop.disable_any_whitespace)
            elif kind == "regex":
                xgr.Grammar.from_regex(sop.regex)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(choice_grammar(sop.choice))  # type: ignore[arg-type]
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(sop.grammar)
            else:
                xgr.Grammar.from_structural_tag(*_structural_tag_args(sop.structural_tag))  # type: ignore[arg-type]
        except ValueError:
            raise
        except Exception as e:  # the library's parse errors (RuntimeError, InvalidJSONError, ...)
            raise ValueError(f"invalid {kind}: {_first_line(e)}") from None

    def compile(self, sop: StructuredOutputsParams) -> Any:
        c, kind = self.compiler, sop.kind
        if kind in ("json", "json_object"):
            return c.compile_json_schema(json.dumps(json_schema_of(sop)), any_whitespace=not sop.disable_any_whitespace)
        if kind == "regex":
            return c.compile_regex(sop.regex)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(sop.choice))  # type: ignore[arg-type]
        if kind == "grammar":
            return c.compile_grammar(sop.grammar)
        return c.compile_structural_tag(*_structural_tag_args(sop.structural_tag))  # type: ignore[arg-type]

    def matcher(self, compiled: Any) -> Matcher:
        return _XgrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(
            [m.m for m, _ in rows], bitmask, [r for _, r in rows])  # type: ignore[attr-defined]


# ---- llguidance -------------------------------------------------------------------------------
class _GuidanceMatcher(Matcher):
    __slots__ = ("m",)

    def __init__(self, m: Any) -> None:
        self.m = m

    def accept(self, token_id: int) -> bool:
        return bool(self.m.consume_token(token_id)) and not self.m.is_error()

    def is_terminated(self) -> bool:
        return bool(self.m.is_stopped())


def _guidance_grammar(sop: StructuredOutputsParams) -> str:
    """The request's structure as an llguidance grammar (its JSON-wrapped form)."""
    import llguidance as llg

    kind = sop.kind
    if kind in ("json", "json_object"):
        defaults: dict[str, Any] = {"whitespace_flexible": not sop.disable_any_whitespace}
        if sop.whitespace_pattern is not None:
            defaults["whitespace_pattern"] = sop.whitespace_pattern
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(json_schema_of(sop)), defaults=defaults)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(sop.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in sop.choice)  # type: ignore[union-attr]
        return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        return llg.LLMatcher.grammar_from_lark(any_to_lark(sop.grammar or ""))  # GBNF or Lark
    raise ValueError("structural_tag needs the xgrammar backend")


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import llguidance as llg
        import llguidance.hf
        import llguidance.torch

        self._llg = llg
        self._fill = llguidance.torch.fill_next_token_bitmask_par
        self.lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)
        self.executor = llg.LLExecutor(1)

    @classmethod
    def unsupported(cls, sop: StructuredOutputsParams) -> str | None:
        if sop.structural_tag is not None:
            return "structural_tag"
        return None

    @classmethod
    def check(cls, sop: StructuredOutputsParams) -> None:
        import llguidance as llg

        if sop.json is not None or sop.json_object:
            validate_json_schema(sop)
        try:
            grammar = _guidance_grammar(sop)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"invalid {sop.kind}: {_first_line(e)}") from None
        error = llg.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"invalid {sop.kind}: {error.strip().splitlines()[0]}")

    def compile(self, sop: StructuredOutputsParams) -> Any:
        grammar = _guidance_grammar(sop)
        error = self._llg.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if error:
            raise ValueError(f"invalid {sop.kind}: {error.strip().splitlines()[0]}")
        return grammar

    def matcher(self, compiled: Any) -> Matcher:
        m = self._llg.LLMatcher(self.lltokenizer, compiled)
        if m.is_error():
            raise ValueError(m.get_error())
        return _GuidanceMatcher(m)

    def fill(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        self._fill(self.executor, [(m.m, r) for m, r in rows], bitmask)  # type: ignore[attr-defined]


BACKEND_CLASSES: dict[str, type[GrammarBackend]] = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}


def choose_backend(sop: StructuredOutputsParams, configured: str) -> str:
    """The backend that enforces `sop`: the configured one, or for 'auto' xgrammar unless it cannot
    enforce the request exactly (then llguidance). Checks the request (tokenizer-free) on it and
    raises ValueError naming the problem."""
    if configured == "auto":
        why = XgrammarBackend.unsupported(sop)
        if why is None:
            XgrammarBackend.check(sop)
            return "xgrammar"
        if sop.disable_fallback:
            raise ValueError(f"xgrammar cannot enforce {why}, and disable_fallback is set")
        why_not = GuidanceBackend.unsupported(sop)
        if why_not is not None:
            raise ValueError(f"no structured-output backend can enforce this request: xgrammar lacks {why}, "
                             f"llguidance lacks {why_not}")
        try:
            GuidanceBackend.check(sop)
        except ValueError as e:
            raise ValueError(f"xgrammar cannot enforce {why}; llguidance: {e}") from None
        return "guidance"
    cls = BACKEND_CLASSES[configured]
    why = cls.unsupported(sop)
    if why is not None:
        raise ValueError(f"the {configured} structured-output backend cannot enforce {why}")
    cls.check(sop)
    return configured
