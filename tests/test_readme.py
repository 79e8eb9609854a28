"""The docs' figures come from committed JSON only: README's headline table and the Results
block of results/README.md are exactly what scripts/results_table.py writes, and the prose
around them (README, docs/, CONTRIBUTING.md, results/README.md) carries no measured figures."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = (("<!-- results:begin -->", "<!-- results:end -->"),
          ("<!-- headline:begin -->", "<!-- headline:end -->"))
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "results" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
# what a measurement looks like: a speedup, a rate, a time, a memory size, a share, a ratio of
# counts, a figure with several decimals
MEASURED = re.compile(r"\b\d+(\.\d+)?x\b|\b\d+(\.\d+)? ?(tok/s|ms|MB|KB|GB/s|%)(?![\w/])"
                      r"|\b\d+ of \d+\b|\b\d+\.\d{2,}\b(?<!3\.11)(?<!0\.95)|\b\d+(\.\d+)? ?(s|min|minutes|hours?) (per|end)\b")


def test_results_block_is_what_the_script_writes():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_table.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def _prose(text: str) -> str:
    """The text outside the generated blocks."""
    for begin, end in BLOCKS:
        if begin in text:
            text = text[:text.index(begin)] + text[text.index(end):]
    return text


def test_prose_outside_the_generated_blocks_has_no_measured_figures():
    assert len(DOCS) >= 8
    for doc in DOCS:
        prose = _prose(doc.read_text())
        hits = [(m.group(0), prose[max(0, m.start() - 40):m.end() + 10]) for m in MEASURED.finditer(prose)]
        assert not hits, (doc.name, hits)


def test_readme_is_a_front_page():
    """Short, with the headline table near the top and every doc it links to present."""
    lines = (ROOT / "README.md").read_text().split("\n")
    assert len(lines) <= 300
    top = "\n".join(lines[:60])
    assert "<!-- headline:begin -->" in top and "| plain llama.cpp" in top
    for link in re.findall(r"\]\(([^)#]+\.md)\)", "\n".join(lines)):
        assert (ROOT / link).is_file(), link


def test_the_figure_check_can_fail():
    for s in ("runs at 1.86x of", "56.8 tok/s", "c(1) 9.9 ms", "adds 28 MB", "6% more",
              "737 of 738 positions", "agreement 0.978", "27 min end to end"):
        assert MEASURED.search(s), s
