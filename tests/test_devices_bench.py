"""Device profiles, plan arithmetic, bench input handling and summaries (no model needed)."""

import json

import pytest

from edgespec.measure.bench import Method, MethodResult, parse_methods, summarize
from edgespec.prompts import read_prompts
from edgespec.measure.devices import get_profile, load_profiles, plan
from edgespec.errors import EdgespecError


def test_profiles_complete_and_cited():
    profiles = load_profiles()
    for name in ["laptop-2core-x86", "raspberry-pi-5", "pixel-8", "snapdragon-8-gen-3",
                 "iphone-15-pro", "jetson-orin-nano"]:
        p = profiles[name]
        assert p["sources"] and p["threads"] >= 1 and 0 < p["app_memory_share"] <= 1
        assert p["draft_min"] <= p["draft_max"]
    with pytest.raises(EdgespecError, match="unknown device"):
        get_profile("toaster")


def test_plan_fit_and_speed():
    r = plan("raspberry-pi-5", target_bytes=250 * 2**20, head_bytes=10 * 2**20,
             kv_bytes_per_token=1024, context=4096, mean_accepted=2.0, draft_len=4)
    assert r["fits"] and r["memory_mb"]["total"] == pytest.approx(264.0)
    bw = 17.1e9 * 0.6
    assert r["target_only_tokens_per_s"] == pytest.approx(bw / (250 * 2**20), rel=1e-3)
    assert r["speculative_tokens_per_s"] == pytest.approx(2.0 * bw / (290 * 2**20), rel=1e-3)
    big = plan("pixel-8", 8 * 2**30, 0, 0, 4096, None, 4)
    assert not big["fits"] and "speculative_tokens_per_s" not in big


def test_read_prompts_errors_name_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "kind": "code"}\n{"prompt": 3}\n')
    with pytest.raises(EdgespecError, match=r"p.jsonl:2"):
        read_prompts(f)
    f.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(EdgespecError, match=r"p.jsonl:2: not valid JSON"):
        read_prompts(f)
    with pytest.raises(EdgespecError, match="no such prompt file"):
        read_prompts(tmp_path / "missing.jsonl")
    f.write_text('{"prompt": "hello", "kind": "prose"}\n')
    assert read_prompts(f) == [{"prompt": "hello", "kind": "prose"}]


def test_shipped_prompts_mixed_kinds():
    from edgespec.prompts import DEFAULT_PROMPTS

    kinds = {p["kind"] for p in read_prompts(DEFAULT_PROMPTS)}
    assert {"code", "prose", "chat"} <= kinds


def test_parse_methods():
    ms = parse_methods("target,lookup,edgespec,edgespec", ["a", "b"], 3)
    assert [m.kind for m in ms] == ["target", "lookup", "edgespec", "edgespec"]
    assert ms[2].draft == "a" and ms[3].draft == "b" and ms[2].name != ms[3].name
    assert parse_methods("lookup", [], 3)[0].kind == "target"  # the baseline is always run
    with pytest.raises(EdgespecError, match="unknown method"):
        parse_methods("target,magic", [], 3)


def _row(tokens, secs, passes, ids, kind):
    return {"labels": {"kind": kind}, "tokens": tokens, "decode_s": secs, "prefill_s": 0.01,
            "verify_passes": passes, "drafted": 2 * passes, "accepted": tokens - passes,
            "accepted_at": [passes, tokens - 2 * passes], "drafted_at": [passes, passes],
            "draft_s": 0.001 * passes, "verify_s": secs * 0.9, "token_ids": ids}


def test_summary_speedup_is_median_of_ratios_and_match_share():
    t = MethodResult(Method("target", "target"), [_row(10, 1.0, 10, [1] * 10, "code"),
                                                  _row(10, 1.0, 10, [2] * 10, "prose"),
                                                  _row(10, 2.0, 10, [3] * 10, "prose")])
    e = MethodResult(Method("edgespec", "edgespec"), [_row(10, 0.5, 5, [1] * 10, "code"),
                                                      _row(10, 0.25, 4, [2] * 9 + [7], "prose"),
                                                      _row(10, 2.0, 6, [3] * 10, "prose")])
    rep = summarize({"target": t, "edgespec": e}, greedy=True)["methods"]
    assert rep["edgespec"]["speedup"] == pytest.approx(2.0)  # ratios 2, 4, 1
    assert rep["edgespec"]["same_as_target_share"] == pytest.approx(2 / 3, abs=1e-4)
    assert rep["edgespec"]["mean_matching_prefix"] == pytest.approx((10 + 9 + 10) / 3, abs=0.01)
    assert rep["edgespec"]["mean_accepted"] == pytest.approx(30 / 15)
    assert rep["edgespec"]["by_kind"]["prose"]["speedup"] == pytest.approx(2.5)
    assert rep["target"]["speedup"] == pytest.approx(1.0)
    assert "speedup_vs_baseline" not in rep["target"]
    json.dumps(rep)
    b = MethodResult(Method("baseline", "target", engine="baseline"),
                     [_row(10, 2.0, 10, [1] * 10, "code"), _row(10, 1.0, 10, [2] * 10, "prose"),
                      _row(10, 2.0, 10, [3] * 10, "prose")])
    rep = summarize({"target": t, "edgespec": e, "baseline": b}, greedy=True)["methods"]
    assert rep["edgespec"]["speedup_vs_baseline"] == pytest.approx(4.0)  # ratios 4, 4, 1
    assert rep["target"]["speedup_vs_baseline"] == pytest.approx(1.0)  # ratios 2, 1, 1
    assert rep["baseline"]["speedup"] == pytest.approx(1.0)  # ratios 0.5, 1, 1
