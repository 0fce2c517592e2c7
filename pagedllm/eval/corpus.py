"""The default perplexity corpus: the Python language reference's topic texts.

Provenance: ``pydoc_data/topics.py`` of the CPython standard library, generated from CPython's
``Doc/reference`` and ``Doc/library`` reStructuredText by Sphinx's pydoc-topics builder; it ships
with every CPython (Debian: ``libpython3.X-stdlib``; the sources are on python.org and in the
CPython repository). Licence: the Python documentation is distributed under the PSF License
Agreement version 2 (code examples under the Zero-Clause BSD licence). The text depends on the
Python minor version, so the cached file is named after it and its SHA-256 is logged; any user
file can be passed instead (``--file``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

from pagedllm.utils import cache_dir

logger = logging.getLogger(__name__)

CORPUS_NAME = "python-reference-topics"


def default_corpus() -> Path:
    """The corpus text file, written once into the cache from the standard library."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = cache_dir() / "corpus" / f"{CORPUS_NAME}-py{version}.txt"
    if not path.is_file():
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k].strip() for k in sorted(topics)) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    logger.info("corpus %s (Python %s reference topics, PSF License, sha256 %s)", path, version, digest)
    return path
