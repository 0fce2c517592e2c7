"""The entry point shared by the peer benchmark children (vllm_worker.py, llamacpp_worker.py).

They run under the peers' python, where pagedllm is not installed; each imports this file from
its own folder (a script's folder is first on sys.path). Standard library only.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable


def child_main(argv: list, run: Callable[[dict], dict]) -> int:
    """Reads the spec named by argv[0], runs it, writes the result (or {"error": ...}) where the
    spec says; exit status 0 on success."""
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        result = run(spec)
    except BaseException as exc:  # noqa: BLE001 - any failure becomes the reported reason
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1
