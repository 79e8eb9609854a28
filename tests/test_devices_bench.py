"""Device profiles, plan arithmetic, bench input handling and summaries (no model needed)."""

import json

import pytest

from edgespec.measure.bench import Method, MethodResult, parse_methods, summarize
from edgespec.prompts import read_prompts
from edgespec.devices import get_profile, load_profiles, plan
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
    """Bandwidth-bound estimates: the target-only rate halves when the target doubles, the
    speculative rate scales with tokens per pass and a free head gives exactly that factor,
    and the memory parts add up against the profile's budget."""
    one = plan("raspberry-pi-5", 250 * 2**20, 0, 1024, 4096, 1.0, 4)
    two = plan("raspberry-pi-5", 500 * 2**20, 0, 1024, 4096, 1.0, 4)
    assert two["target_only_tokens_per_s"] == pytest.approx(one["target_only_tokens_per_s"] / 2, rel=1e-2)
    assert one["speedup"] == pytest.approx(1.0)
    spec2 = plan("raspberry-pi-5", 250 * 2**20, 0, 1024, 4096, 2.0, 4)
    assert spec2["speedup"] == pytest.approx(2.0)
    heavy = plan("raspberry-pi-5", 250 * 2**20, 25 * 2**20, 1024, 4096, 2.0, 4)
    assert 1.0 < heavy["speedup"] < 2.0  # each draft step reads the head
    m = heavy["memory_mb"]
    assert m["total"] == pytest.approx(m["target"] + m["head"] + m["kv_cache"], abs=0.2)
    assert heavy["fits"]
    big = plan("pixel-8", 8 * 2**30, 0, 0, 4096, None, 4)
    assert not big["fits"] and "speculative_tokens_per_s" not in big


def test_plan_target_sizes_real_files(tmp_path):
    """`edgespec plan`'s sizing: a head file or checkpoint folder counts its bytes; a bench
    report without an edgespec row is a clear error, not a traceback."""
    from edgespec.devices import bench_mean_accepted, plan_target
    from test_targets import write_tiny_gguf

    target = write_tiny_gguf(tmp_path / "t.gguf", n_layer=6, window=8)
    head = tmp_path / "h.gguf"
    head.write_bytes(b"\0" * 3 * 2**20)
    r = plan_target("pixel-8", target, draft=str(head), context=64, mean_accepted=2.0)
    assert r["memory_mb"]["head"] == pytest.approx(3.0) and r["draft"] == str(head)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\0" * 2**20)
    assert plan_target("pixel-8", target, draft=str(ckpt))["memory_mb"]["head"] == pytest.approx(1.0)
    assert plan_target("pixel-8", target, draft="lookup")["memory_mb"]["head"] == 0
    with pytest.raises(EdgespecError, match="no head file"):
        plan_target("pixel-8", target, draft=str(tmp_path / "nope.onnx"))
    rep = tmp_path / "b.json"
    rep.write_text(json.dumps({"methods": {"target": {"mean_accepted": 1.0}}}))
    with pytest.raises(EdgespecError, match="no edgespec row"):
        bench_mean_accepted(rep)
    rep.write_text(json.dumps({"methods": {"target": {"mean_accepted": 1.0},
                                           "edgespec": {"mean_accepted": 2.5}}}))
    assert plan_target("pixel-8", target, bench=rep)["mean_accepted"] == 2.5


def test_apply_profile_pins_threads_and_affinity():
    import os

    from edgespec.devices import apply_profile

    before = os.sched_getaffinity(0)
    try:
        rec, use = apply_profile("raspberry-pi-5")
        prof = get_profile("raspberry-pi-5")
        assert use == min(prof["threads"], os.cpu_count())
        assert os.sched_getaffinity(0) == set(range(use))
        assert rec["simulated"] and rec["threads_used"] == use and rec["memory_budget_mb"] > 0
        _, one = apply_profile("raspberry-pi-5", threads=1)
        assert one == 1 and os.sched_getaffinity(0) == {0}
    finally:
        os.sched_setaffinity(0, before)


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
    # lookup runs under the same policy as the head unless told otherwise
    ms = parse_methods("target,lookup,lookup:fixed,edgespec", [], None, policy="cost")
    assert [(m.name, m.policy) for m in ms] == [("target", "fixed"), ("lookup", "cost"),
                                               ("lookup:fixed", "fixed"), ("edgespec", "cost")]
    assert [m.draft_name for m in ms] == ["none", "lookup", "lookup", "default"]
    with pytest.raises(EdgespecError, match="unknown draft policy"):
        parse_methods("lookup:fastest", [], 3)
    # heads of one file name in two folders are labelled by folder, alone or mixed
    ms = parse_methods("edgespec,edgespec,edgespec", ["head:x/head.onnx", "y/head.onnx", "z/other.onnx"], 3)
    assert [m.name for m in ms[1:]] == ["edgespec[head:x/head.onnx]", "edgespec[y/head.onnx]",
                                        "edgespec[other.onnx]"]


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
    assert rep["edgespec"]["speedup_total"] == pytest.approx((30 / 2.75) / (30 / 4.0), abs=1e-4)
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
    assert rep["edgespec"]["speedup_total_vs_baseline"] == pytest.approx((30 / 2.75) / (30 / 5.0), abs=1e-4)
    assert rep["target"]["speedup_vs_baseline"] == pytest.approx(1.0)  # ratios 2, 1, 1
    assert rep["baseline"]["speedup"] == pytest.approx(1.0)  # ratios 0.5, 1, 1


def test_reports_are_append_only(tmp_path):
    from edgespec.measure.bench import write_report

    out = tmp_path / "r.json"
    write_report({"a": 1}, out)
    with pytest.raises(EdgespecError, match="never overwritten"):
        write_report({"a": 2}, out)
    assert json.loads(out.read_text()) == {"a": 1}


def test_scripts_write_results_to_new_files(tmp_path):
    from edgespec.io import write_result

    a = write_result(tmp_path, "ablation-x", {"run": 1})
    b = write_result(tmp_path, "ablation-x", {"run": 2})
    assert (a.name, b.name) == ("ablation-x.json", "ablation-x-run2.json")
    assert json.loads(a.read_text()) == {"run": 1} and json.loads(b.read_text()) == {"run": 2}
