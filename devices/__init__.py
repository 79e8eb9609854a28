"""Device profiles: one TOML file per device class (devices/*.toml), with the sources of each
number.

`load_profiles()` reads them, `apply_profile()` applies what can be applied on this machine
(threads, CPU affinity; the memory budget is checked against the bench's peak RSS), `plan()`
estimates whether target + head + KV cache fit and the bandwidth-bound decode speed, and
`plan_target()` sizes a real target and head for it (what `edgespec plan` runs).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from edgespec.errors import EdgespecError

PROFILES = Path(__file__).resolve().parent
REQUIRED = ("name", "title", "cores", "threads", "ram_gb", "app_memory_share",
            "memory_bandwidth_gbs", "isa", "target_quant", "head_quant",
            "onnx_execution_provider", "draft_min", "draft_max", "sources")
# Share of theoretical bandwidth a decode loop reaches in practice (llama.cpp on phones and
# laptops typically sustains 50-70%); used by `plan`, shown in its output.
BANDWIDTH_EFFICIENCY = 0.6


def load_profiles() -> dict[str, dict]:
    out = {}
    for path in sorted(PROFILES.glob("*.toml")):
        with open(path, "rb") as f:
            prof = tomllib.load(f)
        missing = [k for k in REQUIRED if k not in prof]
        if missing:
            raise EdgespecError(f"{path}: device profile lacks {', '.join(missing)}")
        out[prof["name"]] = prof
    return out


def get_profile(name: str) -> dict:
    profiles = load_profiles()
    if name not in profiles:
        raise EdgespecError(f"unknown device '{name}'; known: {', '.join(profiles)}")
    return profiles[name]


def memory_budget_mb(prof: dict) -> float:
    return prof["ram_gb"] * 1024 * prof["app_memory_share"]


def apply_profile(name: str, threads: int | None = None) -> tuple[dict, int]:
    """Pin threads (and CPU affinity) to the profile where this machine allows; returns the
    device record for the bench report and the thread count to use."""
    prof = get_profile(name)
    n_cpu = os.cpu_count() or 1
    use = min(threads or prof["threads"], n_cpu)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(range(use)))
    record = {"name": prof["name"], "title": prof["title"], "simulated": True,
              "threads_profile": prof["threads"], "threads_used": use,
              "memory_budget_mb": round(memory_budget_mb(prof), 1),
              "draft_bounds": [prof["draft_min"], prof["draft_max"]],
              "note": "measured on this machine with the profile's thread count and budget; "
                      "run on the device itself for a real measurement"}
    return record, use


def plan(device: str, target_bytes: int, head_bytes: int, kv_bytes_per_token: int,
         context: int, mean_accepted: float | None, draft_len: int) -> dict:
    """Fit and bandwidth-bound speed estimate for one device.

    Decoding is memory-bound at batch 1: each target pass reads its weights once, whether it
    checks 1 token or k + 1, and each draft step reads the head once. So
        target-only tokens/s  ~ eff * bandwidth / target_bytes
        speculative tokens/s  ~ mean_accepted * eff * bandwidth / (target_bytes + k * head_bytes)
    an upper bound that ignores compute (a large-vocabulary LM head is compute-heavy on CPU)
    and KV reads.
    """
    prof = get_profile(device)
    kv = kv_bytes_per_token * context
    need = target_bytes + head_bytes + kv
    budget = memory_budget_mb(prof) * 2**20
    bw = prof["memory_bandwidth_gbs"] * 1e9 * BANDWIDTH_EFFICIENCY
    k = max(prof["draft_min"], min(draft_len, prof["draft_max"]))
    out = {"device": prof["name"], "title": prof["title"], "context": context,
           "memory_mb": {"target": round(target_bytes / 2**20, 1), "head": round(head_bytes / 2**20, 1),
                         "kv_cache": round(kv / 2**20, 1), "total": round(need / 2**20, 1),
                         "budget": round(budget / 2**20, 1)},
           "fits": need <= budget, "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
           "target_only_tokens_per_s": round(bw / target_bytes, 1), "draft_len": k}
    if mean_accepted:
        spec = mean_accepted * bw / (target_bytes + k * head_bytes)
        out["speculative_tokens_per_s"] = round(spec, 1)
        out["speedup"] = round(spec / (bw / target_bytes), 3)
        out["mean_accepted"] = mean_accepted
    return out


def head_bytes(draft: str, spec) -> int:
    """Bytes of the head a drafter name loads: "default" (the shipped head), a head file, or a
    checkpoint folder (its weights file); lookup and none load no head."""
    from edgespec.runtime.assets import default_head
    from edgespec.runtime.formats import CKPT_WEIGHTS

    if draft in ("none", "lookup"):
        return 0
    name = draft[len("head:"):] if draft.startswith("head:") else draft
    path = default_head(spec) if name == "default" else Path(name)
    if path.is_dir():
        path = path / CKPT_WEIGHTS
    if not path.is_file():
        raise EdgespecError(f"--draft {draft}: no head file or checkpoint there")
    return path.stat().st_size


def kv_bytes_per_token(spec, context: int) -> int:
    """f16 K and V per token, averaged over a full context: sliding layers hold at most a window."""
    row = 2 * spec.n_head_kv * spec.head_dim * 2
    n_glob = spec.layer_types.count("global")
    win = min(spec.sliding_window or context, context)
    return row * (n_glob * context + (spec.n_layer - n_glob) * win) // context


def bench_mean_accepted(path: str | Path) -> float:
    """Tokens per verify pass of the best drafting row of a bench report (edgespec rows)."""
    from edgespec.io import read_json

    rep = read_json(path)
    rows = [m.get("mean_accepted") for n, m in (rep.get("methods") or {}).items() if n.startswith("edgespec")]
    rows = [r for r in rows if isinstance(r, (int, float))]
    if not rows:
        raise EdgespecError(f"{path}: the bench report has no edgespec row with tokens per pass; "
                            "bench with --methods ...,edgespec")
    return max(rows)


def plan_target(device: str, target, draft: str | None = None, context: int = 4096,
                mean_accepted: float | None = None, bench: str | Path | None = None,
                draft_len: int = 4) -> dict:
    """`plan` for a real target (name or path) and drafter; `bench` takes tokens per pass from a
    bench report."""
    from edgespec.targets import load_target_spec

    spec = load_target_spec(target)
    hb = head_bytes(draft, spec) if draft else 0
    if bench:
        mean_accepted = bench_mean_accepted(bench)
    r = plan(device, spec.file_size, hb, kv_bytes_per_token(spec, context), context, mean_accepted, draft_len)
    r["target"], r["draft"] = spec.name, draft or "none"
    return r
