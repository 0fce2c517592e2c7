"""`pagedllm serve | run-batch | generate | chat | bench | eval | simulate`."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import NoReturn

# Process start, for the time-to-first-token figure that `generate` reports.
_PROCESS_START = time.time()

logger = logging.getLogger("pagedllm")


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One readable line and exit code 2 (not the usage block).
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("-n", "--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)


def sampling_params_from_args(args: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def build_parser() -> argparse.ArgumentParser:
    from pagedllm import __version__, envs
    from pagedllm.engine.arg_utils import EngineArgs

    parser = _Parser(prog="pagedllm", description="LLM inference and serving with a paged KV cache.")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    parser.add_argument("--log-level", default=envs.PAGEDLLM_LOG_LEVEL)
    sub = parser.add_subparsers(dest="command", metavar="{serve,run-batch,generate,chat,bench,eval,simulate}",
                                parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate for prompts and print the results")
    gen.add_argument("prompts", nargs="*", help="prompts (read from stdin, one per line, when none are given)")
    gen.add_argument("--chat-template", dest="use_chat_template", action=argparse.BooleanOptionalAction,
                     default=True, help="wrap each prompt as a user message in the model's chat template")
    add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat; tokens stream as they are produced")
    chat.add_argument("--system", default=None, help="system message")
    add_sampling_args(chat)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=cmd_chat)

    try:
        from pagedllm.entrypoints.openai.cli_args import add_serve_parser

        add_serve_parser(sub)
        from pagedllm.entrypoints.openai.run_batch import add_run_batch_parser

        add_run_batch_parser(sub)
    except ImportError:
        pass
    try:
        from pagedllm.benchmarks_cli import add_bench_parser

        add_bench_parser(sub)
    except ImportError:
        pass
    try:
        from pagedllm.simulator.cli import add_simulate_parser

        add_simulate_parser(sub)
        sub.choices["simulate"].set_defaults(ui_replay=_simulate_ui_replay)
    except ImportError:
        pass
    from pagedllm.eval.cli import add_eval_parser

    add_eval_parser(sub)
    return parser


def _make_llm(args: argparse.Namespace):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    return LLM(engine_args.model, **kwargs)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise CLIError("no prompts given (pass them as arguments or on stdin)")
    llm = _make_llm(args)
    tok = llm.get_tokenizer()
    use_template = args.use_chat_template and getattr(tok.hf, "chat_template", None) is not None
    t0 = time.perf_counter()
    if use_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        for c in out.outputs:
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"Prompt: {prompt}\n{tag}Answer: {c.text.strip()}\n", flush=True)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    first = min((o.metrics.first_token_time for o in outputs if o.metrics and o.metrics.first_token_time), default=None)
    ttft = f", first token {first - _PROCESS_START:.2f} s after process start" if first else ""
    print(
        f"{len(outputs)} prompts: {n_in} prompt tokens, {n_out} output tokens in {elapsed:.2f} s "
        f"({n_out / max(elapsed, 1e-9):.1f} output tokens/s, {(n_in + n_out) / max(elapsed, 1e-9):.1f} total tokens/s)"
        f"{ttft}",
        file=sys.stderr,
        flush=True,
    )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm.sampling_params import RequestOutputKind

    params = sampling_params_from_args(args)
    params.output_kind = RequestOutputKind.DELTA
    if params.n != 1:
        raise CLIError(f"chat streams one answer at a time; got n={params.n}")
    llm = _make_llm(args)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("Type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    turn = 0
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        text = tok.apply_chat_template(history)
        rid = f"chat-{turn}"
        turn += 1
        try:
            engine.add_request(rid, {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)},
                               params)
        except ValueError as e:
            # A turn the engine cannot take (e.g. the conversation outgrew max_model_len) ends only that turn.
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            history.pop()
            continue
        reply = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                piece = out.outputs[0].text if out.outputs else ""
                reply.append(piece)
                print(piece, end="", flush=True)
        print(flush=True)
        history.append({"role": "assistant", "content": "".join(reply)})


def _simulate_ui_replay(recorder: object, args: argparse.Namespace) -> int:
    """`pagedllm simulate --ui`: the recorded run in the web page's engine view."""
    from pagedllm.entrypoints.web.replay import serve_replay

    return serve_replay(recorder, args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"pagedllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        # Bad input (model path, engine flags, sampling values): one readable line.
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"pagedllm {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
