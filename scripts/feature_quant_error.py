"""How far stored hidden states move the teacher: quantize fp16 features with each storage type
and compare the target's distribution over the draft vocabulary (logits = h @ embedding rows).

    .venv/bin/python scripts/feature_quant_error.py runs/gemma/feat-fp16 runs/gemma/head-muon
Writes results/feature-quant-error.json (KL to the fp16 teacher, top-1 agreement, relative error;
a new -runN file where one stands).
"""

import sys

import numpy as np

from edgespec.training.features import Codec, Features, make_transform
from edgespec.io import write_result
from edgespec.targets import embedding_rows
from edgespec.training.train import checkpoint_target, load_checkpoint


def log_softmax(x):
    x = x - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def main(feats_dir: str, ckpt: str, n_samples: int = 10) -> None:
    feats = Features(feats_dir)
    if feats.dtype != "fp16":
        sys.exit("give an fp16 features folder")
    _, meta = load_checkpoint(ckpt)
    rows = embedding_rows(checkpoint_target(meta))[np.asarray(meta["draft_vocab"]["ids"])]
    # as `extract` does, the channel scales come from the first shard; the error is measured on
    # samples after it
    first = feats.manifest["shards"][0]["samples"]
    fit = make_transform(np.concatenate([feats.hidden(i) for i in range(first)]))
    step = max(1, (len(feats) - first) // n_samples)
    h = np.concatenate([feats.hidden(i) for i in range(first, len(feats), step)][:n_samples])
    ref = log_softmax(h @ rows.T)
    p = np.exp(ref)
    out = []
    for dtype, group, kind in [("int8", 32, "none"), ("int8", 32, "dct"), ("int4", 32, "none"),
                               ("int4", 16, "none"), ("int4", 32, "dct")]:
        codec = Codec(dtype, group, fit if kind == "dct" else {"kind": "none"})
        hq = codec.decode(codec.encode(h))
        lq = log_softmax(hq @ rows.T)
        out.append({"dtype": dtype, "group_size": group, "transform": kind,
                    "kl_to_fp16": round(float((p * (ref - lq)).sum(1).mean()), 5),
                    "top1_agreement": round(float((lq.argmax(1) == ref.argmax(1)).mean()), 4),
                    "relative_error": round(float(np.linalg.norm(hq - h) / np.linalg.norm(h)), 4)})
        print(out[-1])
    doc = {"features": feats_dir, "head": ckpt, "tokens": len(h), "draft_vocab": len(rows), "rows": out,
           "note": "channel scales fitted on the first shard, error measured on samples after it"}
    print("wrote", write_result("results", "feature-quant-error", doc))


if __name__ == "__main__":
    main(*sys.argv[1:3])
