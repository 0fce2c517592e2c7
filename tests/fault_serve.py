"""`pagedllm` CLI with test faults installed in every process of the server:

    python tests/fault_serve.py [--sampler-fault SEED[:AFTER]] [--detokenizer-fault TOKEN] serve ...

The faults are installed when this module is imported (see tests/fault_hooks.py). The engine-core
process (and any worker process) is started with multiprocessing's spawn method, which imports the
parent's main module again in the child, as `__mp_main__`, with the parent's sys.argv: the child
parses the same options and installs the same faults before it runs the engine.
"""

from __future__ import annotations

import sys

from fault_hooks import install, parse_sampler_fault


def _split(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The fault options that lead argv, and the CLI's arguments after them."""
    faults: dict[str, str] = {}
    while len(argv) >= 2 and argv[0] in ("--sampler-fault", "--detokenizer-fault"):
        faults[argv[0]], argv = argv[1], argv[2:]
    return faults, argv


_faults, _cli_argv = _split(sys.argv[1:])
_token = _faults.get("--detokenizer-fault")
install(sampler=parse_sampler_fault(_faults.get("--sampler-fault")), detokenizer=None if _token is None else int(_token))

if __name__ == "__main__":
    from pagedllm.entrypoints.cli import main

    sys.exit(main(_cli_argv))
