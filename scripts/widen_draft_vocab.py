"""A trained head with a wider draft vocabulary, no further training.

    .venv/bin/python scripts/widen_draft_vocab.py SRC_CKPT OUT_CKPT N DATA_DIR [DATA_DIR ...]

The head's output lives in the target's hidden space and its frozen draft LM head is the
target's embedding rows of the draft vocabulary, so more rows can be added as they are: the
most frequent tokens of the DATA_DIRs' samples that SRC_CKPT's vocabulary lacks, until it holds
N. Writes OUT_CKPT as a checkpoint (eval-head, export onnx read it).
"""

import collections
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    if len(sys.argv) < 5:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    import torch

    from edgespec.errors import EdgespecError
    from edgespec.training.data import read_data
    from edgespec.training.train import (checkpoint_target, embedding_rows, load_checkpoint,
                                         save_checkpoint)

    src, out, n, data = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    try:
        head, meta = load_checkpoint(src)
        old = np.asarray(meta["draft_vocab"]["ids"], np.int64)
        if n <= len(old):
            raise EdgespecError(f"{src} already holds {len(old)} draft tokens; give N above that")
        counts = collections.Counter()
        for d in data:
            for s in read_data(d)[1]:
                counts.update(s["tokens"])
        have = set(old.tolist())
        extra = [t for t, _ in counts.most_common() if t not in have][:n - len(old)]
        ids = np.sort(np.concatenate([old, np.asarray(extra, np.int64)]))
        head.c.n_draft_vocab = len(ids)
        head.lm_head = torch.from_numpy(np.asarray(embedding_rows(checkpoint_target(meta))[ids], np.float32))
        meta["draft_vocab"] = dict(meta["draft_vocab"], ids=ids)
        save_checkpoint(out, head, meta)
    except EdgespecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{src}: {len(old)} -> {len(ids)} draft tokens, written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
