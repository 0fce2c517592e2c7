"""The benchmark report renders from the committed results (a broken section fails here, not
when someone next regenerates docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_report_renders_every_committed_result(tmp_path):
    doc = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_report.py"), "--doc", str(doc)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = doc.read_text()
    for name, heading in (("throughput.json", "## Offline throughput"), ("latency.json", "## Single-request latency"),
                          ("native_decode.json", "## Decode steps as one native call"),
                          ("prefill.json", "## Long-context prefill")):
        if (ROOT / "benchmarks" / "results" / name).exists():
            assert heading in text, heading
