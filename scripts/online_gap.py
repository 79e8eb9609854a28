"""Where a shared-KV head's online first-draft acceptance parts from its offline one.

    .venv/bin/python scripts/online_gap.py [--head PATH] [--limit 12] [--max-tokens 128]
        [--name NAME]

Greedy decoding of the bench's code and prose prompts with the head alone at a fixed four
drafts (the bench's `edgespec:fixed -k 4`), recording every chain the head proposed. Then, on
the finished text, the target is run once more over it in one go (`sample_hidden`: the rows
extraction stores, in float32) and the same head file drafts a first token at every position
after the prompt from those rows. Reported:
  online        first drafts accepted, over the chains the run proposed (the bench's figure)
  offline_starts  the same head on the re-run rows, at the same chain starts
  offline_all   the same head at every position after the prompt (what eval-head averages)
  rows          how far the rows the run handed the head are from the re-run's
So `online` against `offline_starts` is what the run itself costs (rows, numerics), and
`offline_starts` against `offline_all` is which positions chains start at (a chain starts where
the last one ended, after a missed draft or a full one). Writes results/online-gap-NAME.json.
"""

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="runtime/heads/gemma3-270m/shared-kv-int8.onnx")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--name", default="gemma3-270m")
    a = ap.parse_args()

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.prompts import read_prompts
    from edgespec.runtime.decoding import Generation
    from edgespec.runtime.drafters import drafter_for
    from edgespec.runtime.generate import open_target
    from edgespec.runtime.sampling import SamplingParams
    from edgespec.runtime.spec import SpecConfig
    from edgespec.training.features import sample_hidden

    draft = f"head:{a.head}"
    spec = SpecConfig(draft=draft, k=4, policy="fixed")
    engine = open_target("gemma3-270m", n_ctx=1024, lm_head=spec.lm_head, draft=draft)
    prompts = [p for p in read_prompts() if p.get("kind") in ("code", "prose")][:a.limit]
    sp = SamplingParams()
    per, rows_err = [], {"h": [], "k": [], "v": []}
    ref = drafter_for(draft, engine)  # holds the re-run's rows, split as the run's drafter splits them
    for p in prompts:
        drafter = drafter_for(draft, engine)
        calls = []
        propose = drafter.propose

        def spy(context, hidden, k, *args, _p=propose, _c=calls, **kw):
            d = _p(context, hidden, k, *args, **kw)
            if d.tokens:
                _c.append((len(context) - 1, d.tokens[0]))
            return d

        drafter.propose = spy
        ids = engine.tokenize(p["prompt"])
        gen = Generation(engine, ids, sp, max_tokens=a.max_tokens, drafter=drafter,
                         policy=spec.make_policy(engine, True))
        for _ in gen:
            pass
        seq = ids + list(gen.token_ids)
        n_run = drafter.n
        run_h, run_k, run_v = drafter._h[:n_run].copy(), [x[:n_run].copy() for x in drafter._k], \
            [x[:n_run].copy() for x in drafter._v]
        ref.reset()
        ref.keep(sample_hidden(engine, seq, (), drafter.kv_layers))
        H, K, V = ref._h[:ref.n], [x[:ref.n] for x in ref._k], [x[:ref.n] for x in ref._v]
        m = min(n_run, len(H))

        def rel(x, y):
            return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-9))

        rows_err["h"].append(rel(run_h[:m], H[:m]))
        rows_err["k"].append(float(np.mean([rel(x[:m], y[:m]) for x, y in zip(run_k, K)])))
        rows_err["v"].append(float(np.mean([rel(x[:m], y[:m]) for x, y in zip(run_v, V)])))

        @functools.cache  # each position's draft once: chain starts and every position share them
        def first_draft(q: int) -> int:
            _, lg = drafter.head.step(drafter.embed[np.asarray(seq[q:q + 1])], H[q - 1:q], q,
                                      [x[:q] for x in K], [x[:q] for x in V])
            return drafter._pick(lg[0], 0)[0]

        starts = [(q, t) for q, t in calls if q + 1 < len(seq)]
        online = [t == seq[q + 1] for q, t in starts]
        off_starts = [first_draft(q) == seq[q + 1] for q, _ in starts]
        same = [first_draft(q) == t for q, t in starts]
        every = [first_draft(q) == seq[q + 1] for q in range(len(ids), len(seq) - 1)]
        per.append({"kind": p["kind"], "prompt_tokens": len(ids), "new_tokens": len(gen.token_ids),
                    "chains": len(starts), "online": float(np.mean(online)) if online else None,
                    "offline_starts": float(np.mean(off_starts)) if off_starts else None,
                    "same_first_draft": float(np.mean(same)) if same else None,
                    "offline_all": float(np.mean(every)) if every else None,
                    "counts": {"online": int(sum(online)), "offline_starts": int(sum(off_starts)),
                               "same": int(sum(same)), "starts": len(starts),
                               "offline_all": int(sum(every)), "positions": len(every)}})
        print(p["kind"], {k: (round(v, 3) if isinstance(v, float) else v) for k, v in per[-1].items()
                          if k != "counts"}, flush=True)
    tot = {k: sum(r["counts"][k] for r in per) for k in per[0]["counts"]}
    summary = {"online": tot["online"] / tot["starts"], "offline_starts": tot["offline_starts"] / tot["starts"],
               "same_first_draft": tot["same"] / tot["starts"],
               "offline_all": tot["offline_all"] / tot["positions"], "chains": tot["starts"],
               "positions": tot["positions"],
               "rows_relative_error_median": {k: float(np.median(v)) for k, v in rows_err.items()}}
    print(summary)
    doc = {"made_by": f"scripts/online_gap.py --head {a.head} --limit {a.limit} --max-tokens "
                      f"{a.max_tokens} --name {a.name}", "head": a.head, "summary": summary,
           "per_prompt": per, "machine": machine_info(engine.n_threads if hasattr(engine, "n_threads") else 2)}
    print("wrote", write_result(ROOT / "results", f"online-gap-{a.name}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
