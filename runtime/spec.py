"""How a request speculates: one config for generate, chat, bench, serve and the API."""

from __future__ import annotations

from dataclasses import dataclass

from edgespec.errors import EdgespecError
from edgespec.io import int_at_least
from edgespec.runtime.policies import MAX_DRAFT, POLICIES, FixedK, make_policy

DRAFT_HELP = ("none, lookup, default (the shipped head + lookup), a head file or checkpoint "
              "folder (+ lookup), head:default or head:PATH for a head alone")
K_HELP = ("most tokens drafted per step (default: the engine's: 3 on llama.cpp with its full LM "
          "head, where checking k tokens costs nearly k decodes; 6 with the low-rank or batched "
          f"LM head and on onnxruntime, where it costs far less; at most {MAX_DRAFT})")
LM_HEAD_HELP = ("llama.cpp targets: auto (default: greedy rows through the low-rank search where "
                "a basis ships; rows that need every logit, as sampling does, through the "
                "batched head (llama.cpp's own LM-head rows, every row of a pass in one "
                "onnxruntime call) where the head is Q8_0 or Q4_0 and at least half the model; "
                "else llama.cpp's), full (llama.cpp's own), batched (every row through it), "
                "lowrank, or a basis file made by `edgespec export lowrank-basis`")


@dataclass
class SpecConfig:
    draft: str | None = "default"  # the drafter by name (see runtime.drafters.make_drafter)
    k: int | None = None  # most tokens drafted per step; None: the engine's default
    policy: str = "cost"  # draft-length policy: fixed | confidence | cost
    lm_head: str = "auto"  # the LM head llama.cpp targets verify with (see LlamaTarget)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise EdgespecError(f"unknown draft policy '{self.policy}'; choose from {', '.join(POLICIES)}")
        if self.k is not None and self.k < 0:
            raise EdgespecError(f"draft length must be >= 0, got {self.k}")

    @classmethod
    def from_args(cls, args) -> SpecConfig:
        return cls(draft=args.draft, k=args.k, policy=args.policy, lm_head=args.lm_head)

    def draft_k(self, engine, greedy: bool, drafting: bool = True) -> int:
        """The most tokens drafted per step: the one place that decides it. Without a drafter
        0; else `k`, or the engine's default (`draft_k`, or `draft_k_sampled` for sampling,
        whose verification reads the full LM head); an absurd k is capped at MAX_DRAFT."""
        if not drafting:
            return 0
        k = self.k if self.k is not None else (engine.draft_k if greedy else engine.draft_k_sampled)
        return min(k, MAX_DRAFT)

    def make_policy(self, engine, greedy: bool, drafting: bool = True, store=None):
        """The draft-length policy of one request on `engine` (FixedK(0) without a drafter);
        store: where a cost policy's learned state lives (policies.make_policy)."""
        k = self.draft_k(engine, greedy, drafting)
        return make_policy(self.policy, k, engine, greedy, store=store) if k else FixedK(0)


def add_spec_args(parser, draft: str | None = "default", many_drafts: bool = False) -> None:
    """--draft, -k, --policy and --lm-head, as every command that decodes takes them.
    many_drafts: --draft may repeat (the bench compares heads); its default is then None."""
    if many_drafts:
        parser.add_argument("--draft", action="append", default=None,
                            help=DRAFT_HELP + " (repeat to compare)")
    else:
        parser.add_argument("--draft", default=draft, help=f"{DRAFT_HELP} (default: {draft})")
    parser.add_argument("-k", "--k", type=lambda v: int_at_least(v, 1), default=None, help=K_HELP)
    parser.add_argument("--policy", default="cost", choices=POLICIES,
                        help="draft-length policy (default: cost)")
    parser.add_argument("--lm-head", default="auto", help=LM_HEAD_HELP)
