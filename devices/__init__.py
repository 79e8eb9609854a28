"""Device profiles: one TOML file per device class, with the sources of each number.

`load_profiles()` reads them, `apply_profile()` applies what can be applied on this machine
(threads, CPU affinity; the memory budget is checked against the bench's peak RSS), and `plan()`
estimates whether target + head + KV cache fit and the bandwidth-bound decode speed.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from edgespec.errors import EdgespecError

HERE = Path(__file__).resolve().parent
REQUIRED = ("name", "title", "cores", "threads", "ram_gb", "app_memory_share",
            "memory_bandwidth_gbs", "isa", "target_quant", "head_quant",
            "onnx_execution_provider", "draft_min", "draft_max", "sources")
# Share of theoretical bandwidth a decode loop reaches in practice (llama.cpp on phones and
# laptops typically sustains 50-70%); used by `plan`, shown in its output.
BANDWIDTH_EFFICIENCY = 0.6


def load_profiles() -> dict[str, dict]:
    out = {}
    for path in sorted(HERE.glob("*.toml")):
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
    an upper bound that ignores compute (the 262k-vocabulary LM head is compute-heavy on CPU,
    see NOTES) and KV reads.
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
