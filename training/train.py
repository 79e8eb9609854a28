"""Stage 3-4, the draft vocabulary and training: `MTPHead` on stored (or online) hidden states.

    edgespec train --target gemma3-270m --features runs/gemma/feat --out runs/gemma/head \
        [--optimizer adamw|muon] [--steps N] [--resume]

Loss: forward KL from the target's distribution to the head's, over the draft vocabulary, at
every unrolled draft step (weights decay^(j-1)); the target's logits are recomputed from the
stored hidden states and the frozen draft LM head rows (Gemma ties LM head and embeddings).
Samples whose index hashes to the eval split are held out for `eval-head`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edgespec.errors import EdgespecError, one_line
from edgespec.gguf_meta import TensorRows
from edgespec.io import atomic_write, atomic_write_text, progress
from edgespec.runtime.formats import (CKPT_CONFIG, CKPT_META_CONFIG, CKPT_STATE, CKPT_WEIGHTS, DRAFT_IDS,
                                       Eagle3Config, HeadConfig, SharedKVConfig, head_arch,
                                       read_checkpoint_config)
from edgespec.targets import KNOWN_TARGETS, TargetSpec, embedding_rows, load_target_spec
from edgespec.training.carry import carried_weights, has_carry, load_carry, save_carry
from edgespec.training.carry import recipe as carry_recipe
from edgespec.training.distributed import World, lost_peer
from edgespec.training.features import Features, final_state_only, open_features
from edgespec.training.eagle3 import Eagle3Head
from edgespec.training.head import MTPHead
from edgespec.training.shared_kv import SharedKVHead

EVAL_EVERY = 20  # every 20th sample (by index) is held out


def is_eval(index: int) -> bool:
    return index % EVAL_EVERY == 0


def split_samples(feats, max_train_tokens: int = 0, seed: int = 0) -> tuple[list[int], list[int]]:
    """(training, held-out) sample positions in `feats`: held out are the samples whose data
    index is every EVAL_EVERY-th; a sample whose tokens repeat an earlier one, or any held-out
    one, is not trained on (folders made from overlapping sources share passages). With
    `max_train_tokens`, a fixed random subset of the training samples (by `seed`) up to that
    many tokens: the points of a data-scaling curve."""
    def key(i: int) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(feats.tokens[i]).tobytes(), digest_size=16).digest()

    ids = feats.sample_ids()
    held, held_keys = [], set()
    for i, s in enumerate(ids):
        if is_eval(s) and (k := key(i)) not in held_keys:
            held.append(i)
            held_keys.add(k)
    train, seen = [], set(held_keys)
    for i, s in enumerate(ids):
        if not is_eval(s) and (k := key(i)) not in seen:
            train.append(i)
            seen.add(k)
    if max_train_tokens:
        order = np.random.default_rng([seed, 2]).permutation(len(train))
        keep, total = [], 0
        for j in order:
            if total >= max_train_tokens:
                break
            keep.append(train[j])
            total += len(feats.tokens[train[j]])
        train = sorted(keep)
    return train, held


@dataclass
class TrainConfig:
    steps: int = 800  # optimizer steps
    batch: int = 4  # sequences per step
    seq_len: int = 96  # chain starts per sequence window
    n_steps: int = 4  # draft steps unrolled (training-time test)
    step_decay: float = 0.8  # loss weight of step j is decay^(j-1)
    optimizer: str = "muon"  # 2-D weights (AdamW for the rest); or "adamw" (see the ablation)
    lr: float = 2e-3
    muon_lr: float = 0.02
    weight_decay: float = 0.01
    warmup: int = 100
    clip: float = 1.0
    ce_weight: float = 0.0  # optional cross-entropy on the data token
    topk: int = 10  # top-K distillation: the target's K most likely draft tokens ...
    topk_weight: float = 0.0  # ... weigh this much more in the loss (0: forward KL alone)
    draft_vocab: int = 4096
    seed: int = 0
    max_train_tokens: int = 0  # 0: every training sample; else a fixed random subset this large
    save_every: int = 250
    threads: int = 0  # 0: torch's default
    arch: str = "mtp"  # "mtp" (edgespec's head), "eagle3" (llama.cpp's EAGLE-3 graph) or "shared-kv"
    init_from: str = ""  # a checkpoint whose weights and draft vocabulary a new run starts from

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# -- draft vocabulary -------------------------------------------------------------------------
def build_draft_vocab(token_arrays, n: int, n_vocab: int, always: list[int] = ()) -> dict:
    """The n most frequent target tokens (plus `always`, e.g. EOS), sorted by target id.

    Returns {"ids": target ids, "d2t": offsets (target = draft + d2t[draft]), "coverage"}.
    """
    counts = np.zeros(n_vocab, dtype=np.int64)
    for t in token_arrays:
        np.add.at(counts, np.asarray(t, dtype=np.int64), 1)
    if counts.sum() == 0:
        raise EdgespecError("no tokens to build a draft vocabulary from")
    forced = np.asarray(sorted(set(int(a) for a in always if a is not None and 0 <= a < n_vocab)),
                        dtype=np.int64)
    order = np.argsort(-counts, kind="stable")
    order = order[~np.isin(order, forced)][: max(0, n - len(forced))]
    ids = np.sort(np.concatenate([forced, order]))
    coverage = float(counts[ids].sum() / counts.sum())
    return {"ids": ids.astype(np.int64), "d2t": (ids - np.arange(len(ids))).astype(np.int64),
            "coverage": coverage}


# -- batches ----------------------------------------------------------------------------------
class Batcher:
    """Windows of (tokens, hidden) from training samples, as padded torch tensors.

    Step s's global batch is a pure function of (seed, s): samples are taken in the order of a
    per-epoch permutation (no sample twice in an epoch), each with a window start drawn from
    (seed, s). With several ranks each reads its own share of the global batch (rank r takes
    entries r, r + world, ...), so the batches, hence the run, do not depend on the world
    size, and a resumed run draws what it would have drawn."""

    def __init__(self, feats: Features, indices: list[int], cfg: TrainConfig, embed: TensorRows,
                 seed: int, rank: int = 0, world: int = 1):
        self.f, self.idx, self.cfg, self.embed = feats, list(indices), cfg, embed
        self.seed, self.rank, self.world = seed, rank, world
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, 0, epoch]).permutation(self.idx)}
        return self._perms[epoch]

    def plan(self, step: int) -> tuple[list[int], list[int]]:
        """Step `step`'s global batch: (sample indices, window starts)."""
        c, n = self.cfg, len(self.idx)
        length = c.seq_len + c.n_steps
        samples = [int(self._perm(g // n)[g % n]) for g in range(step * c.batch, (step + 1) * c.batch)]
        rng = np.random.default_rng([self.seed, 1, step])
        starts = [int(rng.integers(0, max(1, len(self.f.tokens[i]) - length + 1))) for i in samples]
        return samples, starts

    def for_step(self, step: int):
        """This rank's share of step `step`'s global batch."""
        samples, starts = self.plan(step)
        return self.batch(samples[self.rank::self.world], starts[self.rank::self.world])

    def batch(self, samples: list[int], starts: list[int]):
        """(tokens, hidden, valid, embeddings) of the windows; features with keys and values
        (a shared-KV head's) also give the target's K/V rows from each sample's start to its
        window's end, which keys are real, and each window's start."""
        c = self.cfg
        length = c.seq_len + c.n_steps  # positions that carry a hidden state or a token
        kv_on = bool(self.f.kv_layers)
        e = self.f.n_embd if kv_on else self.f.width
        toks = np.zeros((len(samples), length), dtype=np.int64)
        hid = np.zeros((len(samples), length, e), dtype=np.float32)
        valid = np.zeros((len(samples), length), dtype=bool)
        if kv_on:
            span = max(s + length for s in starts)
            kv = np.zeros((len(samples), span, self.f.width - e), dtype=np.float32)
            kv_valid = np.zeros((len(samples), span), dtype=bool)
        for b, i in enumerate(samples):
            full = self.f.hidden(i)
            t, h = self.f.tokens[i][starts[b]:starts[b] + length], full[starts[b]:starts[b] + length]
            toks[b, :len(t)], hid[b, :len(t)], valid[b, :len(t)] = t, h[:, :e], True
            if kv_on:
                n = min(len(full), starts[b] + length)
                kv[b, :n], kv_valid[b, :n] = full[:n, e:], True
        uniq, inv = np.unique(toks, return_inverse=True)
        emb = self.embed[uniq][inv.reshape(toks.shape)]
        out = (torch.from_numpy(toks), torch.from_numpy(hid), torch.from_numpy(valid),
               torch.from_numpy(emb))
        if kv_on:
            out += (torch.from_numpy(kv), torch.from_numpy(kv_valid),
                    torch.as_tensor(starts, dtype=torch.long))
        return out


def loss_counts(toks, valid, cfg: TrainConfig, t2d=None) -> torch.Tensor:
    """The positions each unrolled step's loss averages over (KL, then cross-entropy): summed
    over the ranks, they make every rank's share a part of one global-batch mean."""
    n, T = cfg.n_steps, valid.shape[1] - cfg.n_steps
    out = []
    for j in range(n):
        m = (valid[:, j + 1:j + 1 + T] & valid[:, :T]).float()
        out.append(m.sum())
        if cfg.ce_weight and t2d is not None:
            tgt = t2d[toks[:, j + 2:j + 2 + T]]
            out.append((m[:, :tgt.shape[1]] * (tgt >= 0).float()).sum())
    return torch.stack(out).double()


def chain_loss(head: MTPHead, toks, hid, valid, emb, cfg: TrainConfig, t2d, counts, *kv):
    """Weighted KL (plus, with `topk_weight`, the cross-entropy on the target's top-K draft
    tokens once more: a ranking-aware term in the manner of HASS) over unrolled steps; returns
    (loss, per-step top-1 agreement counts).
    `counts`: the positions each mean is over (`loss_counts`, summed over the ranks), so with
    several ranks the loss is this rank's part of the global mean; the agreements are sums
    (divided by the KL counts once summed over the ranks)."""
    n, T = cfg.n_steps, hid.shape[1] - cfg.n_steps
    per = 2 if cfg.ce_weight and t2d is not None else 1
    if kv:  # a shared-KV head: the target's keys and values, which are real, window starts
        outs = head.forward_chain(emb[:, 1:], hid[:, :T], n, valid=valid[:, :T], kv=kv[0],
                                  kv_valid=kv[1], offset=kv[2])
    else:
        outs = head.forward_chain(emb[:, 1:], hid[:, :T], n, valid=valid[:, :T])
    total, accs = 0.0, []
    wsum = sum(cfg.step_decay ** j for j in range(n))
    with torch.no_grad():  # the target's distribution at every position, once for all steps
        p_all_logits = head.teacher_logits(hid[:, 1:])
        p_all = torch.softmax(p_all_logits, -1)
        logp_all = torch.log(p_all.clamp_min(1e-12))
    for j, out in enumerate(outs):  # step j+1 at chain start t predicts x_{t+j+2}
        p_logits, p = p_all_logits[:, j:j + T], p_all[:, j:j + T]
        q_log = torch.log_softmax(head.logits(out).float(), -1)
        m = (valid[:, j + 1:j + 1 + T] & valid[:, :T]).float()
        kl = (p * (logp_all[:, j:j + T] - q_log)).sum(-1)
        if cfg.topk_weight:  # HASS-style: the target's top-K tokens' cross-entropy again
            top_p, top_i = p.topk(min(cfg.topk, p.shape[-1]), dim=-1)
            kl = kl - cfg.topk_weight * (top_p * q_log.gather(-1, top_i)).sum(-1)
        loss_j = (kl * m).sum() / float(max(counts[per * j], 1))
        if per == 2:
            tgt = t2d[toks[:, j + 2:j + 2 + T]]
            mm = m[:, :tgt.shape[1]] * (tgt >= 0).float()
            ce = F.cross_entropy(q_log[:, :tgt.shape[1]].transpose(1, 2), tgt.clamp_min(0),
                                 reduction="none")
            loss_j = loss_j + cfg.ce_weight * (ce * mm).sum() / float(max(counts[per * j + 1], 1))
        total = total + (cfg.step_decay ** j) * loss_j / wsum
        with torch.no_grad():
            agree = float(((q_log.argmax(-1) == p_logits.argmax(-1)).float() * m).sum())
            accs.append(agree)
    return total, accs


class _ChainLoss(torch.nn.Module):
    """The training loss as a module's forward, so DistributedDataParallel can wrap it."""

    def __init__(self, head: MTPHead, cfg: TrainConfig, t2d):
        super().__init__()
        self.head, self.cfg, self.t2d = head, cfg, t2d

    def forward(self, toks, hid, valid, emb, counts, *kv):
        return chain_loss(self.head, toks, hid, valid, emb, self.cfg, self.t2d, counts, *kv)


# -- checkpoints ------------------------------------------------------------------------------
def save_checkpoint(folder: Path, head: MTPHead, meta: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    state[DRAFT_IDS] = torch.as_tensor(meta["draft_vocab"]["ids"])
    cfg = dict(meta)
    cfg["draft_vocab"] = {k: v for k, v in meta["draft_vocab"].items() if k not in ("ids", "d2t")}
    cfg["head"] = head.c.to_dict()
    text = json.dumps(cfg, indent=1)
    # The weights file carries its config (the checkpoint is whole after this one rename);
    # config.json follows as the readable copy.
    atomic_write(folder / CKPT_WEIGHTS,
                 lambda tmp: save_file(state, tmp, metadata={CKPT_META_CONFIG: text}))
    atomic_write_text(folder / CKPT_CONFIG, text)


def make_head(config: dict):
    """An untrained head of the architecture and shape a checkpoint's config gives."""
    arch = head_arch(config)
    if arch == "eagle3":
        return Eagle3Head(Eagle3Config.from_dict(config))
    if arch == "shared-kv":
        return SharedKVHead(SharedKVConfig.from_dict(config))
    return MTPHead(HeadConfig.from_dict(config))


def load_checkpoint(folder: str | Path) -> tuple[MTPHead | Eagle3Head, dict]:
    from safetensors.torch import load_file

    folder = Path(folder)
    meta = read_checkpoint_config(folder)
    try:
        state = load_file(str(folder / CKPT_WEIGHTS))
    except Exception as e:
        raise EdgespecError(f"{folder / CKPT_WEIGHTS}: unreadable ({e})") from None
    head = make_head(meta["head"])
    ids = state.pop(DRAFT_IDS)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise EdgespecError(f"{folder}: checkpoint does not match its config "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    meta["draft_vocab"]["ids"] = ids.numpy()
    head.eval()
    return head, meta


def load_head(folder: str | Path) -> tuple[MTPHead | Eagle3Head | SharedKVHead, dict]:
    """A checkpoint, or the weights a carried state (`train --carry DIR`) reached, whatever its
    recipe: (head, meta) either way. A carried head's frozen LM head comes from the rows of the
    target its meta names."""
    folder = Path(folder)
    if (folder / CKPT_CONFIG).exists() or not has_carry(folder):
        return load_checkpoint(folder)
    weights, meta = carried_weights(folder)
    try:
        head = _head_from(meta, weights, embedding_rows(checkpoint_target(meta)))
    except RuntimeError as e:
        raise EdgespecError(f"{folder}: carried weights do not match their config ({one_line(e)})") from None
    head.eval()
    return head, meta


def _head_from(meta: dict, weights: dict, embed):
    """The head `meta` describes with carried `weights`, its frozen LM head the target's rows of
    the draft vocabulary again (the carried state leaves them out)."""
    head = make_head(meta["head"])
    weights["lm_head"] = torch.from_numpy(np.asarray(embed[meta["draft_vocab"]["ids"]], np.float32))
    head.load_state_dict(weights)
    return head


def _restore_carry(carried, carry, out: Path, state_path: Path, embed, log) -> None:
    """Where the carried state (`load_carry`) is newer than `out`'s own (or `out` has none),
    write it to `out` as a checkpoint and train_state.pt (the frozen LM head from the target's
    rows again)."""
    st, meta = carried
    if state_path.exists():
        mine = torch.load(state_path, weights_only=False, map_location="cpu")["step"]
        if mine >= st["step"]:
            return
    head = _head_from(meta, st["head"], embed)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out, head, meta)
    atomic_write(state_path, lambda tmp: torch.save(st, tmp))
    log(f"resuming from the state carried in {carry} (step {st['step']})")


def _check_writable(out: Path) -> None:
    """Fail before training, not after it, when the checkpoint folder cannot be written."""
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise EdgespecError(f"{out}: cannot write a checkpoint here ({e.strerror})") from None


def head_config_for(spec: TargetSpec, n_draft_vocab: int, **overrides) -> HeadConfig:
    """Default head for a target: its width, window, RoPE bases and norm epsilon."""
    c = HeadConfig(n_embd=spec.n_embd, n_draft_vocab=n_draft_vocab,
                   sliding_window=spec.sliding_window or 4096,
                   rope_base_local=spec.rope_base_local or spec.rope_base_global,
                   rope_base_global=spec.rope_base_global, rms_eps=spec.rms_eps,
                   embed_scale=spec.embed_scale)
    if not spec.sliding_window:
        c.layer_types = ["global"] * c.n_layer
    for k, v in overrides.items():
        setattr(c, k, v)
    return c


def eagle3_config_for(spec: TargetSpec, n_draft_vocab: int, layers) -> Eagle3Config:
    """An EAGLE-3 head for a target: one decoder layer shaped like the target's own (heads,
    KV heads, head width, FFN width), its RoPE base and norm epsilon, over three layer inputs."""
    if len(layers) != 3:
        raise EdgespecError("--arch eagle3 needs features of three layer inputs: extract with "
                            "--layers A,B,C (e.g. --layers eagle3)")
    return Eagle3Config(n_embd=spec.n_embd, n_draft_vocab=n_draft_vocab,
                        target_layers=[int(i) for i in layers], n_head=spec.n_head,
                        n_head_kv=spec.n_head_kv, head_dim=spec.head_dim, n_ff=spec.n_ff,
                        rope_base=spec.rope_base_global, rms_eps=spec.rms_eps,
                        context_length=spec.n_ctx_train)


def shared_kv_config_for(spec: TargetSpec, n_draft_vocab: int, kv_layers, **overrides) -> SharedKVConfig:
    """A shared-KV head for a target: one head layer per KV layer the features hold, of that
    layer's type, the target's query and KV head shapes, window, RoPE bases, norm epsilon."""
    if not kv_layers:
        raise EdgespecError("--arch shared-kv needs features with the target's keys and values: "
                            "extract with --kv")
    types = [spec.layer_types[i] for i in kv_layers]
    c = SharedKVConfig(n_embd=spec.n_embd, n_draft_vocab=n_draft_vocab, kv_layers=[int(i) for i in kv_layers],
                       layer_types=types, n_head=spec.n_head, n_head_kv=spec.n_head_kv,
                       head_dim=spec.head_dim, d_model=spec.n_embd,
                       sliding_window=spec.sliding_window or 4096,
                       rope_base_local=spec.rope_base_local or spec.rope_base_global,
                       rope_base_global=spec.rope_base_global, rms_eps=spec.rms_eps,
                       embed_scale=spec.embed_scale)
    for k, v in overrides.items():
        if not hasattr(c, k):
            raise EdgespecError(f"a shared-KV head has no option {k}")
        setattr(c, k, v)
    return c


def new_head(spec: TargetSpec, cfg: TrainConfig, n_draft_vocab: int, layers=(), kv_layers=(),
             **overrides):
    if cfg.arch == "eagle3":
        return Eagle3Head(eagle3_config_for(spec, n_draft_vocab, layers))
    if cfg.arch == "shared-kv":
        return SharedKVHead(shared_kv_config_for(spec, n_draft_vocab, kv_layers, **overrides))
    if cfg.arch != "mtp":
        raise EdgespecError(f"unknown --arch {cfg.arch}; choose mtp, eagle3 or shared-kv")
    if layers:
        raise EdgespecError("these features hold layer inputs (for --arch eagle3); the MTP head "
                            "reads the final hidden state only: extract without --layers")
    return MTPHead(head_config_for(spec, n_draft_vocab, **overrides))


# -- training ---------------------------------------------------------------------------------
class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights: Nesterov momentum, then the update orthogonalized by a quintic
    Newton-Schulz iteration, scaled to AdamW's update RMS (`match_rms_adamw`: 0.2 sqrt(max(A, B))),
    decoupled weight decay. The same update as torch.optim.Muon, but the iteration runs in
    float32: torch.optim.Muon casts to bfloat16, and on CPUs without bf16 matmul units (this AVX2
    machine) is many times slower than float32."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0, ns_steps=5, eps=1e-7):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      ns_steps=ns_steps, eps=eps))

    @staticmethod
    def orthogonalize(g, steps: int, eps: float):
        a, b, c = 3.4445, -4.7750, 2.0315
        x = g.float()
        tall = x.shape[0] > x.shape[1]
        if tall:
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                u = self.orthogonalize(p.grad.lerp(buf, group["momentum"]), group["ns_steps"], group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(u.to(p.dtype), alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))


def _optimizers(head: MTPHead, cfg: TrainConfig):
    params = [p for p in head.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(0.9, 0.95))]
    if cfg.optimizer == "muon":
        mats = [p for p in params if p.ndim == 2]
        rest = [p for p in params if p.ndim != 2]
        return [Muon(mats, lr=cfg.muon_lr, weight_decay=cfg.weight_decay),
                torch.optim.AdamW(rest, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))]
    raise EdgespecError(f"unknown optimizer {cfg.optimizer}; choose adamw or muon")


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    prog = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))


def _warm_start(cfg: TrainConfig, spec, head_overrides):
    """A new run that starts from another checkpoint's weights and draft vocabulary (continued
    training: fresh optimizer state and learning-rate schedule). The checkpoint may be a carried
    state (`--carry DIR` of an earlier run, of any recipe): its weights at the step it carries,
    so a run on other data need not re-make the carried run's features first."""
    if head_overrides:
        raise EdgespecError("--init-from takes the head's shape from the checkpoint; "
                            "drop the head options")
    src = Path(cfg.init_from)
    if not (src / CKPT_CONFIG).exists() and not has_carry(src):
        raise EdgespecError(f"--init-from {src}: no checkpoint there")
    head, m = load_head(src)
    if m["target_fingerprint"] != spec.tokenizer_fingerprint:
        raise EdgespecError(f"--init-from {src} is a head for another target")
    if head_arch(m["head"]) != cfg.arch:
        raise EdgespecError(f"--init-from {src} is a {head_arch(m['head'])} head, not {cfg.arch}")
    head.train()
    cfg.draft_vocab = int(len(m["draft_vocab"]["ids"]))  # the config records the vocabulary it has
    return head, {"ids": m["draft_vocab"]["ids"], "coverage": m["draft_vocab"]["coverage"]}


def train(target, features: str | Path, out: str | Path, cfg: TrainConfig | None = None,
          resume: bool = False, head_overrides: dict | None = None, log=print,
          world: World | None = None, carry: str | Path | None = None) -> dict:
    """Train (or resume) a head. Under torchrun each rank runs this (see `distributed`): the
    ranks split every global batch, rank 0 writes the checkpoints and shows progress.
    carry: a folder that also gets the run's resumable state, small enough to commit, with each
    checkpoint (training/carry.py); with `resume`, a state there newer than `out`'s is where
    the run continues."""
    own_world = world is None
    world = World.from_env() if own_world else world
    try:
        return _train(target, features, out, cfg or TrainConfig(), resume, head_overrides,
                      log if world.main else (lambda m: None), world, carry)
    finally:
        if own_world:
            world.close()


def _train(target, features, out, cfg: TrainConfig, resume: bool, head_overrides, log,
           world: World, carry=None) -> dict:
    if cfg.batch % world.size:
        raise EdgespecError(f"--batch {cfg.batch} does not split over {world.size} ranks: "
                            "give a multiple of the number of ranks")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    spec = load_target_spec(target)
    feats = open_features(features)
    if cfg.arch == "mtp":  # features with layer inputs too: the MTP head reads the final state
        feats = final_state_only(feats)
    elif cfg.arch == "shared-kv" and getattr(feats, "layers", ()):
        raise EdgespecError(f"{features} holds layer inputs (for --arch eagle3); a shared-KV head "
                            "reads the final hidden state and the keys and values: extract with --kv")
    if feats.fingerprint != spec.tokenizer_fingerprint:
        raise EdgespecError(f"{features} holds features of another target (fingerprint "
                            f"{feats.fingerprint} != {spec.tokenizer_fingerprint})")
    train_idx, _ = split_samples(feats, cfg.max_train_tokens, cfg.seed)
    if len(train_idx) < 2 or feats.n_tokens < 200:
        raise EdgespecError(f"{features}: too little data ({len(feats)} samples, "
                            f"{feats.n_tokens} tokens); make more with `edgespec data`")
    out = Path(out)
    if world.main:
        _check_writable(out)
    state_path = out / CKPT_STATE
    embed = embedding_rows(spec)
    rec = carry_recipe(feats, cfg) if carry else None
    if carry and has_carry(carry) and not resume:
        raise EdgespecError(f"{carry} already carries a run: pass --resume to continue it, or "
                            "another --carry")
    if resume and has_carry(carry):  # every rank checks it (a refusal stops them all)
        carried = load_carry(carry, rec, asdict(TrainConfig()))
        if world.main:
            _restore_carry(carried, carry, out, state_path, embed, log)
    world.barrier()
    if resume and state_path.exists():
        head, meta = load_checkpoint(out)
        if meta["target_fingerprint"] != spec.tokenizer_fingerprint:
            raise EdgespecError(f"{out} is a head for another target")
        state = torch.load(state_path, weights_only=False, map_location="cpu")
        start, cfg = state["step"], TrainConfig.from_dict(state["config"])
        if carry:  # what is carried from now on: the run as it goes on
            rec = carry_recipe(feats, cfg)
        if "head" in state:  # the state file is whole on its own: its weights go with its step
            head.load_state_dict(state["head"])
        vocab = {"ids": meta["draft_vocab"]["ids"], "coverage": meta["draft_vocab"]["coverage"]}
    else:
        if out.exists() and (out / CKPT_CONFIG).exists() and not resume:
            raise EdgespecError(f"{out} already holds a checkpoint; pass --resume or a new --out")
        if cfg.init_from:
            head, vocab = _warm_start(cfg, spec, head_overrides)
        else:
            vocab = build_draft_vocab([feats.tokens[i] for i in train_idx], cfg.draft_vocab,
                                      spec.n_vocab, always=[spec.eos_id])
            head = new_head(spec, cfg, len(vocab["ids"]), getattr(feats, "layers", ()),
                            getattr(feats, "kv_layers", ()), **(head_overrides or {}))
            head.lm_head.copy_(torch.from_numpy(embed[vocab["ids"]]))
        start, state = 0, None
        meta = {}
    if tuple(getattr(feats, "kv_layers", ())) != tuple(getattr(head.c, "kv_layers", ())):
        raise EdgespecError(f"{features} holds the keys and values of layers "
                            f"{list(getattr(feats, 'kv_layers', ())) or 'none'}; the head in {out} reads "
                            f"{list(getattr(head.c, 'kv_layers', ())) or 'none'}")
    if tuple(getattr(feats, "layers", ())) != tuple(getattr(head.c, "target_layers", ())):
        raise EdgespecError(f"{features} holds features of layers {list(getattr(feats, 'layers', ()))}; "
                            f"the head in {out} reads {list(getattr(head.c, 'target_layers', ())) or 'none'}")
    head.lm_head.requires_grad_(False)
    head.to(world.device)
    t2d = torch.full((spec.n_vocab,), -1, dtype=torch.long)
    t2d[torch.as_tensor(vocab["ids"])] = torch.arange(len(vocab["ids"]))
    t2d = t2d.to(world.device)
    opts = _optimizers(head, cfg)
    if state is not None:
        for o, s in zip(opts, state["optimizers"]):
            o.load_state_dict(s)
    base_lrs = [[g["lr"] for g in o.param_groups] for o in opts]
    if state is not None:
        base_lrs = state["base_lrs"]
    # a resumed run draws the batches it would have drawn: they depend on the step alone
    batcher = Batcher(feats, train_idx, cfg, embed, seed=cfg.seed, rank=world.rank, world=world.size)
    if state is not None and "torch_rng" in state:
        torch.set_rng_state(state["torch_rng"])
    meta.update({
        "format": "edgespec-head", "version": 1, "target": spec.name, "target_path": spec.path,
        "target_fingerprint": spec.tokenizer_fingerprint, "target_arch": spec.arch,
        "draft_vocab": {"ids": vocab["ids"], "size": int(len(vocab["ids"])),
                        "coverage": round(float(vocab["coverage"]), 4)},
        "train": {**asdict(cfg), "features": (feats.manifest["data"] if feats.dtype == "online" else
                               [str(f) for f in features] if isinstance(features, (list, tuple)) else str(features)),
                  "features_dtype": feats.dtype,
                  "train_samples": len(train_idx), "train_tokens": int(sum(len(feats.tokens[i]) for i in train_idx)),
                  "trainable_parameters": head.trainable_parameters(),
                  "world_size": world.size, "backend": world.backend or "single process"},
    })
    log(f"head: {head.trainable_parameters() / 1e6:.2f}M trainable parameters, draft vocab "
        f"{len(vocab['ids'])} (covers {vocab['coverage']:.1%} of training tokens), "
        f"{len(train_idx)} training samples, {cfg.optimizer}"
        + (f", {world.size} ranks ({world.backend})" if world.size > 1 else ""))
    head.train()
    model = world.wrap(_ChainLoss(head, cfg, t2d))
    per = 2 if cfg.ce_weight else 1
    bar = progress(total=cfg.steps, initial=start, desc="train", unit="step", show=world.main)
    t0, hist = time.time(), (state or {}).get("history", [])
    meta["train"].update(steps_done=start, seconds=(state or {}).get("seconds", 0.0), history=hist)
    for step in range(start, cfg.steps):
        for o, lrs in zip(opts, base_lrs):
            for g, lr in zip(o.param_groups, lrs):
                g["lr"] = lr * _lr_factor(step, cfg)
        toks, hid, valid, emb, *kv = (x.to(world.device) for x in batcher.for_step(step))
        try:
            counts = world.sum(loss_counts(toks, valid, cfg, t2d).to(world.device))
            loss, agrees = model(toks, hid, valid, emb, counts, *kv)
            for o in opts:
                o.zero_grad(set_to_none=True)
            # DDP averages the ranks' gradients; each rank's loss is its part of the global mean
            (loss * world.size).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.clip)
            for o in opts:
                o.step()
            sums = world.sum(torch.tensor([loss.item(), *agrees], dtype=torch.float64,
                                          device=world.device)).tolist()
        except RuntimeError as e:  # gloo/nccl report a dead or hung peer as RuntimeError kinds
            if world.size > 1:
                raise lost_peer(world, e, step) from None
            raise
        loss_v = sums[0]
        accs = [a / max(float(counts[per * j]), 1.0) for j, a in enumerate(sums[1:])]
        bar.update(1)
        bar.set_postfix(loss=f"{loss_v:.3f}", acc1=f"{accs[0]:.2f}")
        if step % 50 == 0 or step == cfg.steps - 1:
            hist.append({"step": step, "loss": round(loss_v, 4),
                         "agree": [round(a, 3) for a in accs]})
        if world.main and ((step + 1) % cfg.save_every == 0 or step == cfg.steps - 1):
            meta["train"]["steps_done"] = step + 1
            meta["train"]["seconds"] = round(time.time() - t0 + (state or {}).get("seconds", 0), 1)
            meta["train"]["history"] = hist
            if feats.dtype == "online":
                meta["train"]["online"] = {"target_tokens": feats.target_tokens,
                                           "target_seconds": round(feats.target_seconds, 1)}
            save_checkpoint(out, head, meta)
            st = {"step": step + 1, "config": asdict(cfg), "base_lrs": base_lrs,
                  "optimizers": [o.state_dict() for o in opts], "history": hist,
                  "seconds": meta["train"]["seconds"], "head": head.state_dict(),
                  "torch_rng": torch.get_rng_state()}
            atomic_write(state_path, lambda tmp: torch.save(st, tmp))
            if carry:
                save_carry(carry, st, {**meta, "head": head.c.to_dict(), "draft_vocab": {
                    **meta["draft_vocab"], "ids": [int(x) for x in vocab["ids"]]}}, rec)
    bar.close()
    head.eval()
    return meta


# -- offline evaluation -------------------------------------------------------------------------
@torch.no_grad()
def eval_head(ckpt: str | Path, features, max_chain: int = 8,
              max_samples: int = 200, start_from: int = 0, online: bool = False,
              all_samples: bool = False) -> dict:
    """Offline acceptance on held-out samples (a features folder, or `OnlineFeatures` to run the
    target on the held-out data samples instead): for every chain start t, draft greedily for up
    to `max_chain` steps and compare with the target's argmax over the full vocabulary.

    `online`: `features` is a data folder, and the target runs over its held-out samples.
    Reports per-position acceptance (conditional on all earlier drafts accepted; a chain is
    followed only while the text goes where greedy decoding would, `chain_counts`) and the
    expected accepted length of chains of 1..max_chain drafts (from those rates).
    `start_from` counts only chain starts at that position or later (the head still reads
    everything before), e.g. past the sliding window, or past the prompt of target-written text.
    `all_samples`: score every sample (up to `max_samples`), not only the held-out twentieth, for
    a folder made from text no head trained on (held-out passages).
    """
    head, meta = load_head(ckpt)
    spec = checkpoint_target(meta)
    if online:  # `features` is a data folder: the head's own target runs over it
        from edgespec.training.features import OnlineFeatures

        features = OnlineFeatures(spec.path if spec.name not in KNOWN_TARGETS else spec.name, features,
                                  layers=tuple(getattr(head.c, "target_layers", ())),
                                  kv_layers=tuple(getattr(head.c, "kv_layers", ())))
    feats = open_features(features)
    if feats.fingerprint != meta["target_fingerprint"]:
        raise EdgespecError(f"{features} holds features of another target than the head's")
    want = tuple(getattr(head.c, "target_layers", ()))
    want_kv = tuple(getattr(head.c, "kv_layers", ()))
    if tuple(feats.kv_layers) != want_kv and (want_kv or want):
        raise EdgespecError(f"{features} holds the keys and values of layers "
                            f"{list(feats.kv_layers) or 'none'}; this head reads {list(want_kv) or 'none'}")
    if not want and not want_kv:  # an MTP head reads the final hidden state, stored first
        feats = final_state_only(feats)
    if tuple(getattr(feats, "layers", ())) != want:
        raise EdgespecError(f"{features} holds features of layers {list(getattr(feats, 'layers', ()))}; "
                            f"this head reads {list(want) or 'the final hidden state only'}")
    idx = (list(range(len(feats.sample_ids()))) if all_samples else split_samples(feats)[1])[:max_samples]
    if not idx:
        raise EdgespecError(f"{features}: no held-out samples (every {EVAL_EVERY}th sample)")
    embed = embedding_rows(spec)
    full = torch.from_numpy(embed[0:embed.n_rows])  # the target's LM head (tied), [V, E]
    ids = torch.as_tensor(meta["draft_vocab"]["ids"])
    tried = np.zeros(max_chain, dtype=np.int64)  # per draft position: chains that reached it
    hits = np.zeros(max_chain, dtype=np.int64)  # ... and whose draft there was accepted
    n_samples, text_same, text_n = 0, 0, 0
    for i in idx:
        toks = torch.as_tensor(feats.tokens[i].astype(np.int64))
        hid = torch.from_numpy(feats.hidden(i))
        T = len(toks) - max_chain - 1
        if T <= start_from:
            continue
        target_next = (hid[:, :full.shape[1]] @ full.T).argmax(-1)  # the target's greedy token after each position
        emb = torch.from_numpy(embed[toks.numpy()])[None]
        if want_kv:  # the target's keys and values from the sample's start
            e = feats.n_embd
            outs = head.forward_chain(emb[:, 1:], hid[None, :T, :e], max_chain, kv=hid[None, :, e:],
                                      kv_valid=torch.ones(1, len(hid), dtype=torch.bool))
        else:
            outs = head.forward_chain(emb[:, 1:], hid[None, :T], max_chain)
        drafts = [ids[head.logits(out[0]).argmax(-1)] for out in outs]
        t, a = chain_counts(drafts, target_next, toks, start_from)
        tried += t
        hits += a
        n_samples += 1
        same = toks[2:T + 1] == target_next[1:T]
        text_same += int(same[start_from:].sum())
        text_n += int(same[start_from:].numel())
    if not n_samples:
        raise EdgespecError(f"no held-out sample is longer than --start-from {start_from} + {max_chain + 1}")
    per_pos = [float(h / n) if n else 0.0 for h, n in zip(hits, tried)]
    expected = np.cumsum(np.cumprod(per_pos)).tolist()
    return {"samples": n_samples, "positions": int(tried[0]),
            "acceptance_by_position": [round(x, 4) for x in per_pos],
            "expected_accepted": {str(k): round(v, 4) for k, v in zip(range(1, max_chain + 1), expected)},
            "chains_by_position": [int(n) for n in tried],
            # how often the text's next token is the target's greedy choice: where it is not,
            # a chain cannot be followed past that token (run time would read the target's choice)
            "text_is_target_choice": round(text_same / max(text_n, 1), 4),
            "draft_vocab": meta["draft_vocab"]["size"], "features_dtype": feats.dtype,
            "start_from": start_from,
            "head_train": {k: meta.get("train", {}).get(k) for k in
                           ("train_tokens", "train_samples", "steps_done", "seconds", "max_train_tokens")}}


def chain_counts(drafts, target_next, toks, start_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per draft position j: (chains that reached it, chains whose draft there was accepted),
    over chain starts t >= `start_from` of one sample.

    `drafts[j][t]`: the head's draft j + 1 at chain start t (draft 1 follows the text's token
    t + 1); `target_next[u]`: the target's greedy token after position u; `toks`: the text.
    Draft j is accepted where it is the target's choice after t + j + 1. Draft j (j >= 1) was
    made reading the text's token t + j + 1 as the previous draft, which at run time is the
    target's choice after t + j: where the text goes elsewhere, the chain's run-time context
    is not in the text and it is not followed further (counted as reaching the earlier
    positions only, neither accepted nor rejected there)."""
    n = len(drafts)
    T = len(drafts[0])
    alive = torch.ones(T, dtype=torch.bool)  # earlier drafts accepted, the text on the target's path
    tried, hits = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for j, d in enumerate(drafts):
        if j:
            alive &= toks[j + 1:j + 1 + T] == target_next[j:j + T]
        ok = d == target_next[j + 1:j + 1 + T]
        tried[j] = int(alive[start_from:].sum())
        alive &= ok
        hits[j] = int(alive[start_from:].sum())
    return tried, hits


def checkpoint_target(meta: dict) -> TargetSpec:
    """The target a checkpoint was trained for (by known name, else by its recorded path),
    checked against the checkpoint's tokenizer fingerprint."""
    spec = load_target_spec(meta["target"] if meta["target"] in KNOWN_TARGETS else meta["target_path"])
    if spec.tokenizer_fingerprint != meta["target_fingerprint"]:
        raise EdgespecError(f"target {meta['target']} does not match the head's fingerprint")
    return spec
