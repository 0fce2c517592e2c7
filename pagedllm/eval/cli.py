"""``pagedllm eval perplexity``: llama.cpp's perplexity on a text file (default corpus: see corpus.py)."""

from __future__ import annotations

import argparse


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    ev = sub.add_parser("eval", help="quality checks (perplexity)")
    ev_sub = ev.add_subparsers(dest="eval_command", metavar="{perplexity}", required=True,
                               parser_class=type(ev))
    ppl = ev_sub.add_parser("perplexity", help="perplexity with llama.cpp's convention (second half of each window)")
    ppl.add_argument("--file", "-f", default=None, help="UTF-8 text file (default: the built-in corpus)")
    ppl.add_argument("--ctx", "-c", type=int, default=512, help="tokens per window")
    ppl.add_argument("--chunks", type=int, default=None, help="at most this many windows")
    ppl.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    EngineArgs.add_cli_args(ppl)
    ppl.set_defaults(func=cmd_perplexity)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.eval.perplexity import perplexity

    engine_args = EngineArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    if kwargs.get("max_model_len") is None:
        kwargs["max_model_len"] = args.ctx + 1
    result = perplexity(engine_args.model, args.file, ctx=args.ctx, chunks=args.chunks,
                        progress=args.progress, **kwargs)
    print(f"{result.windows} windows of {result.ctx} tokens, {result.scored_tokens} tokens scored, "
          f"{result.tokens_per_s:.1f} tokens/s")
    print(f"Final estimate: {result.line()}")
    return 0
