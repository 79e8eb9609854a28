"""Several generations on one engine (runtime/batching.py): slots decode in combined batches,
each as it would alone; a slot that goes quiet or an engine error stalls no one; the slot cost
policy drafts less as the batch fills. On the real Gemma 3 (integration): a sequence's logits
in a batch with others are its own (no cross-talk), and concurrent greedy requests through the
server are the target's greedy text up to batch numerics."""

import threading
import time

import numpy as np
import pytest

from edgespec.errors import EdgespecError
from edgespec.runtime.api import SpeculativeLlama
from edgespec.runtime.batching import Batcher, Part, SlotCostAware
from edgespec.runtime.policies import VerifyCost
from mock import MockMulti, MockTarget, NoisyOracle

PROMPTS = ["abcabcabc", "hello world", "zzzyx", "the cat sat on the mat"]


def run_threads(fn, n: int, timeout: float = 60) -> None:
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a slot never finished"


# (sampled text equals the solo text only where both draw the same drafts: without drafting)
@pytest.mark.parametrize("draft,temperature", [("lookup", 0.0), ("oracle", 0.0), ("none", 0.9)])
def test_slots_generate_together_what_each_would_alone(draft, temperature):
    eng = MockMulti(n_seq=4, vocab=26, seed=7, n_ctx=4 * 256)
    # a generous wait, and every slot generating from the start: on a loaded machine a thread
    # can start (or be scheduled) late, and a slot that decodes alone combines nothing
    b = Batcher(eng, 4, max_wait=2.0)

    def llm(target):
        s = SpeculativeLlama(target, draft="lookup" if draft == "lookup" else None, seed=5)
        if draft == "oracle":
            s.drafter = NoisyOracle(target if isinstance(target, MockTarget) else eng, err=0.3)
        return s

    solo = llm(MockTarget(vocab=26, seed=7, n_ctx=256))
    # each call's seed given: without one a call draws it from the object's last (llama_cpp.Llama's rule)
    want = [solo.create_completion(p, max_tokens=40, temperature=temperature, seed=5)["choices"][0]["text"]
            for p in PROMPTS]
    llms = [llm(b.slot(i)) for i in range(4)]
    got = [None] * 4

    def run(i):
        got[i] = llms[i].create_completion(PROMPTS[i], max_tokens=40, temperature=temperature,
                                           seed=5)["choices"][0]["text"]
        b.deactivate(i)

    for i in range(4):
        b.activate(i)
    run_threads(run, 4)
    assert got == want
    assert max(len(batch) for batch in eng.batches) >= 2  # decodes were combined
    assert eng.prefill_only == 0  # each prompt went with its request's first decode
    seqs = {seq for batch in eng.batches for seq, _ in batch}
    assert seqs == {0, 1, 2, 3}
    # the rollbacks of rejected drafts touched each slot's own sequence only
    for i in range(4):
        assert eng.seqs[i] == b.slot(i).tokens


def test_a_quiet_slot_stalls_no_one_and_errors_reach_every_request():
    eng = MockMulti(n_seq=2, vocab=12, seed=1, n_ctx=512)
    b = Batcher(eng, 2, max_wait=0.05)
    b.activate(1)  # generating, but never hands in a decode
    t0 = time.perf_counter()
    logits, _, _ = b.run(Part(0, 0, [1, 2, 3], "last"))
    assert time.perf_counter() - t0 < 2 and logits.shape == (1, 12)
    b.deactivate(1)

    class Broken(MockMulti):
        def decode_parts(self, parts):
            if any(p.tokens == [9] for p in parts):
                raise RuntimeError("llama_decode failed with code 1")
            return super().decode_parts(parts)

    b = Batcher(Broken(n_seq=2, vocab=12, seed=1, n_ctx=512), 2, max_wait=1.0)
    errors = []
    b.activate(0)
    b.activate(1)

    def run(i):
        try:
            b.run(Part(i, 0, [9] if i == 0 else [1], "last"))
        except RuntimeError as e:
            errors.append((i, str(e)))

    run_threads(run, 2)
    assert sorted(i for i, _ in errors) == [0, 1]  # the whole batch failed, both were told
    b.deactivate(0)
    assert b.run(Part(1, 0, [1, 2], "last"))[0].shape == (1, 12)  # and the batcher goes on


def test_slot_cost_policy_drafts_less_as_the_batch_fills():
    eng = MockMulti(n_seq=8, vocab=12, seed=1, n_ctx=8 * 64)
    b = Batcher(eng, 8)
    # a batch of n rows costs 10 ms + 6 ms per row (as Gemma 3 270M on two cores): a draft
    # token pays alone, but next to seven other requests it slows all eight
    b.costs[True] = VerifyCost([0.010 + 0.006 * n for n in range(1, 8 * 5 + 1)])
    p = SlotCostAware(b, 0, 4, b.costs[True])
    b.step_s["head"] = 0.0005
    p.accs["head"] = [0.8] * 4  # a head right 80% of the time at each position
    assert p.k == 4 and p.limit("head") >= 2  # alone: draft
    for s in range(1, 8):  # seven other requests generating, one row and token each a pass
        b.activate(s)
    b.last_rows = {s: 1 for s in range(1, 8)}
    b.emitted = {s: 1.0 for s in range(1, 8)}
    assert p.limit("head") == 0  # seven others waiting: decode plainly
    assert p.others == 7 and p.view.offset == 7
    b.costs[True] = VerifyCost([0.010 + 0.0001 * n for n in range(1, 8 * 5 + 1)])
    p.view.cost = b.costs[True]
    assert p.limit("head") >= 3  # unless rows cost next to nothing


def test_a_slot_keeps_to_its_share_of_the_context():
    b = Batcher(MockMulti(n_seq=2, vocab=12, seed=1, n_ctx=64), 2)
    slot = b.slot(0)
    assert slot.n_ctx == 32
    with pytest.raises(EdgespecError, match="context is full"):
        slot.prefill(list(range(12)) * 3)
    with pytest.raises(EdgespecError, match="holds 2 sequences"):
        Batcher(MockMulti(n_seq=2), 4)


@pytest.mark.integration
def test_gemma3_sequences_in_one_batch_keep_their_own_logits():
    """Teacher-forced, four prompts decoded one token per step: alone, then all four in one
    batch. Batch numerics move logits a little (llama.cpp's kernels change with the batch
    size); another sequence's content would move them a lot and flip most argmaxes."""
    from edgespec.runtime.llama_target import LlamaTarget

    eng = LlamaTarget("gemma3-270m", n_ctx=4 * 256, n_seq=4, lm_head="full")
    try:
        texts = ["The history of the Roman Empire", "def fibonacci(n):",
                 "Once upon a time there", "SELECT name FROM"]
        ids = [eng.tokenize(t) for t in texts]

        def run(together: bool, forced=None):
            for i in range(4):
                eng.seq_clear(i)
            eng.decode_parts([Part(i, 0, ids[i][:-1], "none", logits=False) for i in range(4)])
            pos, cur, rows = [len(x) - 1 for x in ids], [x[-1] for x in ids], []
            for s in range(16):
                parts = [Part(i, pos[i], [cur[i]], "last") for i in range(4)]
                out = (eng.decode_parts(parts) if together
                       else [eng.decode_parts([p])[0] for p in parts])
                rows.append([o[0][0] for o in out])
                for i in range(4):
                    pos[i] += 1
                    cur[i] = forced[s][i] if forced else int(np.argmax(rows[-1][i]))
            return rows

        alone = run(False)
        forced = [[int(np.argmax(r)) for r in step] for step in alone]
        together = run(True, forced)
        # each batched row against its own sequence's row alone, and against the other
        # sequences' rows of the same step (what a mixed-up cache would hand out)
        own = np.mean([np.abs(sa[i] - st[i]).mean() for sa, st in zip(alone, together) for i in range(4)])
        other = np.mean([np.abs(sa[j] - st[i]).mean() for sa, st in zip(alone, together)
                         for i in range(4) for j in range(4) if j != i])
        agree = np.mean([np.argmax(a) == np.argmax(t) for sa, st in zip(alone, together)
                         for a, t in zip(sa, st)])
        assert own < 0.05 * other, (own, other)
        assert agree >= 0.9, agree
    finally:
        eng.close()
