"""How the engine starts its processes: fork where that is safe, else spawn.

A forked worker starts from a copy of the engine's process and runs the worker's function; a
spawned one starts a new interpreter, which imports the main script again before it runs
anything. A script that creates a parallel engine at its top level, without an
`if __name__ == "__main__":` guard, therefore works with fork (as with vLLM, which forks its CPU
workers) and fails with spawn.

Forking is safe only while the process runs nothing but the calling thread: the child gets that
thread alone, and a thread pool whose threads stayed behind in the parent hangs the child the
first time it is used. GNU OpenMP's pool (torch's intra-op threads, started by the first parallel
op) is one, ZeroMQ's I/O threads are another, and other Python threads may hold locks. CUDA
cannot be used in a child forked after the parent initialised it. Pools that stop their threads
before a fork and start them again when next used (OpenBLAS's, which numpy starts on import) do
not count: a throwaway fork lets them stop, then the threads still running are counted. Nor
does tqdm's monitor thread, which progress bars leave running and a worker never meets. Any other
thread (the tokenizers' pool, once the front end has encoded or decoded in parallel, counts too)
means spawn.

Where forking is unsafe the processes are spawned, and a main script that is starting them from
its top level outside the guard is refused at once, with one line that says what to change.
"""

from __future__ import annotations

import ast
import logging
import multiprocessing as mp
import os
import sys
import threading
import tokenize
import warnings
from multiprocessing.context import BaseContext

logger = logging.getLogger(__name__)

_GUARD = 'if __name__ == "__main__":'


class UnguardedMainError(RuntimeError):
    """The processes would be spawned, and spawning would run the main script again in each."""


def _thread_ids() -> set[int] | None:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return None


def _threads_left_by_fork() -> set[int] | None:
    """This process's threads (native ids) once the pools that stop for a fork have stopped
    (OpenBLAS's): a child that exits at once is forked, which runs their fork handlers."""
    ids = _thread_ids()
    if ids is None or len(ids) == 1:
        return ids
    with warnings.catch_warnings():  # Python 3.12 warns of a fork in a threaded process; this child only exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped by the program's own SIGCHLD handler
        pass
    return _thread_ids()


def _benign(thread: threading.Thread) -> bool:
    """tqdm's monitor: it sleeps, and now and then looks at tqdm's bars under tqdm's lock, which
    a worker never takes (it is left running by bars of tqdm's subclasses, as Hugging Face's)."""
    return type(thread).__module__ == "tqdm._monitor"


def fork_hazard() -> str | None:
    """Why forking this process now would be unsafe, or None where it is safe."""
    if not sys.platform.startswith("linux"):
        return f"fork is not used on {sys.platform}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    me = threading.current_thread()
    benign = [t for t in threading.enumerate() if t is not me and _benign(t)]
    others = [t.name for t in threading.enumerate() if t is not me and t not in benign]
    if others:
        return f"other Python threads run ({', '.join(others)})"
    ids = _threads_left_by_fork()
    if ids is None:
        return "this process's threads cannot be counted"
    extra = ids - {threading.get_native_id()} - {t.native_id for t in benign}
    if extra:
        return f"{len(extra)} native threads run besides this one: an OpenMP pool once torch has run a parallel " \
               "op, ZeroMQ's I/O threads, the tokenizers' pool once it has encoded in parallel, ..."
    return None


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]


def unguarded_main_line() -> str | None:
    """"<script>, line N" where the main script, running its top level outside an
    `if __name__ == "__main__":` block, is the caller of this (so spawn would run that line again
    in every child); None otherwise (a guarded call, a call from a thread or a callback, no script)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return None
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if spec_name == "__main__" or spec_name.endswith(".__main__"):
        return None  # spawn does not run a package's __main__ again
    top = None
    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            top = frame
        frame = frame.f_back
    if top is None:
        return None
    line = top.f_lineno
    try:
        with tokenize.open(path) as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            if _is_main_guard(node) and line > (node.test.end_lineno or node.lineno):
                return None
            break
    return f"{path}, line {line}"


def _check_not_importing_main(what: str) -> None:
    if getattr(mp.current_process(), "_inheriting", False):
        raise UnguardedMainError(f"{what} cannot start in a spawned process while it imports the main script: "
                                 f"put the script's top-level code under `{_GUARD}`")


def check_spawn_allowed(what: str, reason: str = "") -> None:
    """Raises UnguardedMainError (one line: what to change) where spawning `what` would run the
    main script's unguarded top level again, or where this process is itself a spawned child
    importing the main script."""
    _check_not_importing_main(what)
    why = f", since {reason}" if reason else ""
    where = unguarded_main_line()
    if where is not None:
        raise UnguardedMainError(
            f"{what} would be spawned{why}, and a spawned process runs {where} again: "
            f"put the script's top-level code under `{_GUARD}`")


def process_context(what: str) -> BaseContext:
    """The multiprocessing context to start `what` with: fork where forking is safe now, else
    spawn (after check_spawn_allowed)."""
    _check_not_importing_main(what)
    hazard = fork_hazard()
    if hazard is None:
        logger.debug("%s: forking", what)
        return mp.get_context("fork")
    check_spawn_allowed(what, f"forking is unsafe here ({hazard})")
    logger.debug("%s: spawning, since forking is unsafe here (%s)", what, hazard)
    return mp.get_context("spawn")
