"""README's figures come from committed JSON only: its Results block is exactly what
scripts/results_table.py writes, and the prose around it carries no measured figures."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
# what a measurement looks like: a speedup, a rate, a time, a memory size, a share, a ratio of
# counts, a figure with several decimals
MEASURED = re.compile(r"\b\d+(\.\d+)?x\b|\b\d+(\.\d+)? ?(tok/s|ms|MB|KB|GB/s|%)(?![\w/])"
                      r"|\b\d+ of \d+\b|\b\d+\.\d{2,}\b(?<!3\.11)(?<!0\.95)|\b\d+(\.\d+)? ?(s|min|minutes|hours?) (per|end)\b")


def test_results_block_is_what_the_script_writes():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_table.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_prose_outside_the_results_block_has_no_measured_figures():
    text = (ROOT / "README.md").read_text()
    prose = text[:text.index(BEGIN)] + text[text.index(END):]
    hits = [(m.group(0), prose[max(0, m.start() - 40):m.end() + 10]) for m in MEASURED.finditer(prose)]
    assert not hits, hits


def test_the_figure_check_can_fail():
    for s in ("runs at 1.86x of", "56.8 tok/s", "c(1) 9.9 ms", "adds 28 MB", "6% more",
              "737 of 738 positions", "agreement 0.978", "27 min end to end"):
        assert MEASURED.search(s), s
