"""The files of `pagedllm run-batch`: the input (a local path, `-` for stdin, or an http(s) URL read
with GET) and the output (a local path, appended to and resumed, or `-` for stdout).

A rerun with the same output file skips what it already holds: each input line is known by its
`custom_id` (lines whose custom_id cannot be read, such as malformed JSON, all share one key), and
the first k input lines with a key are skipped when the output holds k lines with that key. The
output's lines are complete JSON documents each ending in a newline; a last line without its
newline (the process was killed while writing it) is cut off and its input line runs again.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import sys
from typing import IO

logger = logging.getLogger(__name__)


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def read_input(source: str) -> list[str]:
    """The input's physical lines (split on newlines only: JSON text may hold U+2028 and the like)."""
    if source == "-":
        text = sys.stdin.read()
    elif is_url(source):
        text = asyncio.run(_http_get(source))
    else:
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot read the input file {source!r}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"the input file {source!r} is not UTF-8 text: {e}") from None
    return [line.rstrip("\r") for line in text.split("\n")]


async def _http_get(url: str) -> str:
    import aiohttp

    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            if resp.status != 200:
                raise ValueError(f"GET {url} answered HTTP {resp.status}")
            return await resp.text(encoding="utf-8")
    except aiohttp.ClientError as e:
        raise ValueError(f"cannot read the input file {url}: {e}") from None


def check_output(target: str) -> None:
    if is_url(target):
        raise ValueError(f"-o {target}: the output must be a local file or - (stdout); upload it afterwards")
    if target != "-" and os.path.isdir(target):
        raise ValueError(f"-o {target} is a directory")


def resume_output(path: str) -> collections.Counter:
    """How many complete lines the output file `path` holds per custom_id (None for lines
    without one); cuts off a partial last line."""
    counts: collections.Counter = collections.Counter()
    if path == "-" or not os.path.exists(path):
        return counts
    try:
        with open(path, "rb+") as f:
            data = f.read()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                f.truncate(end)
                logger.warning("%s ended in a partial line (%d bytes): it is cut off and its request runs again",
                               path, len(data) - end)
    except OSError as e:
        raise ValueError(f"cannot read the output file {path!r} to resume it: {e.strerror or e}") from None
    for number, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            line = None
        if not isinstance(line, dict) or "custom_id" not in line or "response" not in line:
            raise ValueError(f"the output file {path!r} line {number} is not a batch output line; "
                             "give -o a new file, or remove it to start over")
        custom_id = line["custom_id"]
        counts[custom_id if isinstance(custom_id, str) else None] += 1
    return counts


class OutputWriter:
    """Appends whole lines to the output and flushes each, so an interruption loses none it wrote."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.file: IO[str]
        if target == "-":
            self.file = sys.stdout
        else:
            try:
                self.file = open(target, "a", encoding="utf-8")
            except OSError as e:
                raise ValueError(f"cannot write the output file {target!r}: {e.strerror or e}") from None
        self.written = 0

    def write(self, line: str) -> None:
        self.file.write(line + "\n")
        self.file.flush()
        self.written += 1

    def close(self) -> None:
        if self.file is not sys.stdout:
            os.fsync(self.file.fileno())
            self.file.close()
