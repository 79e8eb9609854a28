"""Why a greedy run's text leaves plain llama.cpp's: batch numerics or the LM head.

Greedy speculative decoding emits the target's own argmax at every position, but llama.cpp's
numbers for a row depend on the batch the row was decoded in (a verify pass holds several rows,
plain decoding one), and edgespec's low-rank LM head picks each row's argmax from a candidate
search. Either can flip a near tie, after which the two texts go their own ways. For a run whose
text differs from the reference's, this looks at the first position where they part, on the
reference's own context (the texts agree up to it), with llama.cpp's full LM head:

- the reference row: the context decoded as plain llama.cpp decodes it (the prompt in its
  batches, then one token at a time); its argmax is the reference's token (checked) and the
  gap to the run's token is the margin the flip overcame;
- batch splits: the same context with its last j tokens decoded as one batch, for each j in
  SPLITS (the shapes of verify passes); each split's argmax.

If some split's argmax is the run's token, the full LM head itself picks it in a batch of that
shape: "batch numerics". If no split picks it, the full head picks the reference's token (or
another) in every shape tried, so the run's token came from its own LM head (the low-rank
search): "lm head". A run that stopped where the other went on is "length".

Given the run's low-rank LM head, an "lm head" departure says more (`lowrank`): the low-rank
search run on the reference row's own hidden state (the one-token decode's) either leaves the
reference's token out of its candidates ("reference not a candidate": a wider search or a
certificate would catch it), or keeps it and still picks another token ("rescored to another":
the candidates' exact logits differ from llama.cpp's), or picks the reference's token ("picks the
reference here": the run's hidden state at that position was not the one-token decode's, through
the batches its cache was filled in).
"""

from __future__ import annotations

import statistics

import numpy as np

SPLITS = (2, 3, 4, 5, 7)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (None where they are equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Diagnosis:
    """The causes of greedy runs' departures from the reference, on one engine with the full LM
    head (the bench's plain engine), caching each context's rows (several methods often part
    from the reference at the same place)."""

    def __init__(self, engine, lowrank=None):
        self.engine = engine
        self.lowrank = lowrank  # the runs' low-rank LM head (runtime/lowrank.py), if they had one
        self._rows: dict[tuple, tuple[np.ndarray, dict[int, int], dict]] = {}

    def _context_rows(self, ids: list[int], ref: list[int], p: int) -> tuple[np.ndarray, dict[int, int], dict]:
        key = (tuple(ids), tuple(ref[:p]))
        if key not in self._rows:
            eng = self.engine
            eng.reset()
            row = eng.prefill(list(ids), last_logits=True)
            for t in ref[:p]:
                logits, _ = eng.decode([t], all_logits=False)
                row = logits[-1]
            row = np.array(row, dtype=np.float32, copy=True)
            ctx = list(ids) + list(ref[:p])
            picks = {}
            for j in SPLITS:
                if j >= len(ctx):
                    break
                eng.truncate(len(ctx) - j)
                logits, _ = eng.decode(ctx[-j:], all_logits=True)
                picks[j] = int(np.argmax(logits[-1]))
            search = {}
            if self.lowrank is not None:  # the search on the one-token row's hidden state
                eng.truncate(len(ctx) - 1)
                _, hid = eng.decode(ctx[-1:], hidden=True)
                h = np.ascontiguousarray(hid[-1:], dtype=np.float32)
                search = {"candidates": {int(c) for c in np.asarray(self.lowrank.candidates(h))[0]},
                          "pick": int(np.argmax(self.lowrank.top_logits(h)[0]))}
            eng.reset()
            self._rows[key] = (row, picks, search)
        return self._rows[key]

    def explain(self, ids: list[int], ref: list[int], out: list[int]) -> dict | None:
        """Why `out` (a greedy run on prompt `ids`) differs from `ref` (the reference's tokens):
        None where they are equal."""
        p = first_difference(out, ref)
        if p is None:
            return None
        if p >= len(out) or p >= len(ref):
            return {"at": p, "why": "length"}
        row, picks, search = self._context_rows(ids, ref, p)
        r, o = int(ref[p]), int(out[p])
        d = {"at": p, "reference_token": r, "run_token": o,
             "margin": round(float(row[r] - row[o]), 4),
             "split_picks": {str(j): t for j, t in picks.items()}}
        if int(np.argmax(row)) != r:
            d["why"] = "reference not reproduced"  # the reference's own decoding is not repeatable
        elif o in picks.values():
            d["why"] = "batch numerics"
        else:
            d["why"] = "lm head"
            if search:
                d["search"] = ("reference not a candidate" if r not in search["candidates"] else
                               "picks the reference here" if search["pick"] == r else
                               "rescored to another")
        return d

    def summary(self, prompts: list[list[int]], refs: list[list[int]], outs: list[list[int]]) -> dict:
        """Counts of each cause over prompts, the median margin, and each prompt's diagnosis."""
        per = [self.explain(i, r, o) for i, r, o in zip(prompts, refs, outs)]
        counts: dict[str, int] = {"same": sum(d is None for d in per)}
        for d in per:
            if d is not None:
                counts[d["why"]] = counts.get(d["why"], 0) + 1
        margins = [d["margin"] for d in per if d is not None and "margin" in d]
        search: dict[str, int] = {}
        for d in per:
            if d is not None and "search" in d:
                search[d["search"]] = search.get(d["search"], 0) + 1
        return {"counts": counts, "lm_head_search": search,
                "median_margin": round(statistics.median(margins), 4) if margins else None,
                "per_prompt": per}
