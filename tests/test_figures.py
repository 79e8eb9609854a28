"""The bench tables in results/README.md and README's headline, recomputed from the raw figures
in each report's JSON (tokens and decode seconds per method, per prompt where a report keeps
them), without scripts/results_table.py: a table cell that says something else is a wrong figure."""

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOL = 0.011  # two-decimal cells: one unit of rounding either way


def _rows(text: str, caption: str) -> dict[str, list[str]]:
    """The markdown table right after the line that starts with `caption`: method -> cells."""
    lines = text[text.index(caption):].split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    out = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = cells
    return out


def _pair(cell: str) -> tuple[float, float]:
    a, b = re.findall(r"([\d.]+)x", cell)[:2]
    return float(a), float(b)


def _rate(m: dict) -> float:
    return m["tokens"] / m["decode_s"]


def _median(m: dict, ref: dict) -> float | None:
    """The median of per-prompt speed ratios, where the report kept per-prompt figures."""
    if "per_prompt" not in m or "per_prompt" not in ref:
        return None
    return statistics.median((a["tokens"] / a["decode_s"]) / (b["tokens"] / b["decode_s"])
                             for a, b in zip(m["per_prompt"], ref["per_prompt"]))


def check_bench_tables(text: str) -> int:
    """Every bench report's table in `text` against its JSON; the rows compared."""
    checked = 0
    for path in sorted((ROOT / "results").glob("bench-*.json")):
        r = json.loads(path.read_text())
        table = _rows(text, f"`results/{path.name}`: target")
        ms, base = r["methods"], r["methods"].get("baseline") if r.get("baseline") else None
        for name, m in ms.items():
            cells = table[name]
            assert abs(float(cells[2]) - _rate(m)) <= 0.051, (path.name, name, cells[2])
            med, tot = _pair(cells[3])
            assert abs(tot - _rate(m) / _rate(ms["target"])) <= TOL, (path.name, name, "total", tot)
            want = _median(m, ms["target"])
            if want is not None:
                assert abs(med - want) <= TOL, (path.name, name, "median", med)
            if base:
                bmed, btot = _pair(cells[4])
                assert abs(btot - _rate(m) / _rate(base)) <= TOL, (path.name, name, "vs baseline", btot)
                want = _median(m, base)
                if want is not None:
                    assert abs(bmed - want) <= TOL, (path.name, name, "median vs baseline", bmed)
            checked += 1
    return checked


def test_every_bench_table_agrees_with_its_json():
    assert check_bench_tables((ROOT / "results" / "README.md").read_text()) > 100


def test_the_headline_agrees_with_its_json():
    text = (ROOT / "README.md").read_text()
    name = re.search(r"\(`results/(bench-[^`]+\.json)`\)", text).group(1)
    r = json.loads((ROOT / "results" / name).read_text())
    rows = _rows(text, "<!-- headline:begin -->")
    ms = r["methods"]
    labels = {"plain llama.cpp (the reference)": "target", "edgespec default (shipped head + lookup)":
              "edgespec", "edgespec prompt lookup (cost policy)": "lookup"}
    for label, method in labels.items():
        cells = rows[label]
        assert abs(float(cells[1]) - _rate(ms[method])) <= 0.051, (label, cells[1])
        assert abs(_pair(cells[2])[1] - _rate(ms[method]) / _rate(ms["target"])) <= TOL, label
    srv = r["peers"]["llama-server"]
    stock = next(c for label, c in rows.items() if label.startswith("stock llama.cpp"))
    assert srv["best_speculative"] in stock[0]
    assert abs(float(stock[1]) - srv["configs"][srv["best_speculative"]]["tokens_per_s"]) <= 0.051


def test_the_recomputation_catches_a_wrong_cell():
    """The check fails on the figure the old table script wrote: the smollm2 ONNX run's
    edgespec row against its baseline, total, showed the target row's ratio (1.45x, not 0.91x)."""
    import pytest

    text = (ROOT / "results" / "README.md").read_text()
    right = "| edgespec | cost | 70.7 | 1.40x / 1.45x | 0.84x / 0.91x |"
    assert right in text
    with pytest.raises(AssertionError, match="vs baseline"):
        check_bench_tables(text.replace(right, "| edgespec | cost | 70.7 | 1.40x / 1.45x | 0.84x / 1.45x |"))


def test_the_app_view_agrees_with_its_json():
    """README's drop-in-against-llama_cpp.Llama table, recomputed from each call's tokens and
    wall seconds."""
    text = (ROOT / "README.md").read_text()
    name = re.search(r"\(`results/(workload-[^`]+\.json)`", text).group(1)
    r = json.loads((ROOT / "results" / name).read_text())
    rows = _rows(text, "The app's view")
    rate = lambda rs: sum(x["tokens"] for x in rs) / sum(x["seconds"] for x in rs)  # noqa: E731
    for w in r["rows"]:
        cells, ours, ref = rows[w["name"]], w["per_prompt"]["edgespec"], w["per_prompt"]["llama_cpp.Llama"]
        assert abs(float(cells[2]) - rate(ref)) <= 0.051 and abs(float(cells[3]) - rate(ours)) <= 0.051
        med, tot = _pair(cells[4])
        assert abs(tot - rate(ours) / rate(ref)) <= TOL, w["name"]
        assert abs(med - statistics.median(rate([a]) / rate([b]) for a, b in zip(ours, ref))) <= TOL
