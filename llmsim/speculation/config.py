"""Speculative decoding: the draft, how often its tokens are accepted, and how k is chosen.

A draft (a small model, or an n-gram / prompt-lookup speculator that costs nothing)
proposes ``k`` tokens per sequence; the target verifies them in one pass over
``k + 1`` positions, keeps the longest accepted prefix and always adds one token of
its own (the correction, or a bonus when all ``k`` were accepted). A step thus emits
between 1 and ``k + 1`` tokens per sequence.

Acceptance is decided token by token with *common random numbers*: whether the draft
gets output position ``m`` of request ``r`` right is one uniform number
``U(r, m)`` derived by hashing (seed, r, m). Two configurations that differ in k, in
the policy or in the hardware therefore see the same draft successes on the same
tokens, so their difference is the configuration, not the dice. Processes:

- ``bernoulli``: every draft token is accepted with probability ``alpha`` (Leviathan's
  i.i.d. model, so E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha));
- ``beta``: each request draws its own alpha from Beta(a, b) (code is easier to
  guess than chat), then accepts i.i.d. at that rate;
- ``positional``: the j-th draft token (j = 0, 1, ...) is accepted with
  ``alpha * decay^j``, since the draft drifts further from the target the longer it runs;
- ``replay``: accepted lengths measured at some k (a CSV column) are replayed,
  truncated to the k in use (the accepted prefix at a smaller k is a prefix of it).
- ``predicted``: bernoulli at the alpha :mod:`llmsim.speculation.acceptance_model` predicts
  for the draft/target pair (family, size ratio, distillation, the draft's dtype) or the
  head, and the workload (chat, code, math, summarisation, translation), fitted to the
  published points shipped in ``data/acceptance.yaml``; a measured alpha (the other
  processes) overrides it.

k policies (see :class:`KPolicy`): ``static``; ``adaptive``, the 80/50 rule from
practice; ``goodput``, which picks each step the k that maximises expected tokens per
second of the whole batch from the cost model and the estimated acceptance
(SmartSpec, arXiv 2406.14066).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from collections.abc import Callable

import numpy as np
import pandas as pd

from llmsim.config.policies import (AcceptanceProcess, Batching, DraftPlacement, KPolicyName, KScope, ProposerKind,
                                    Scorer, members_of)
from llmsim.config.reader import Node, NumberRange
from llmsim.workload.trace import read_csv
from llmsim.catalog.models import ModelSpec
from llmsim.speculation.acceptance_model import WORKLOADS, Estimate, default_model
from llmsim.compiled import EntryPoint
from llmsim.speculation.kernels import (ACCEPTED_PREFIXES_SIGNATURE, REPLAYED_PREFIXES_SIGNATURE, accepted_prefixes,
                                          replayed_prefixes)
from llmsim.speculation.proposers import (EAGLE, HEAD_KINDS, MEDUSA, MODEL, MTP, NGRAM,
                                          NGRAM_CPU_S_PER_CONTEXT_TOKEN, Proposer, head_spec)

# Draft levels (k_max) at most: four times the largest published drafts (EAGLE-2's evaluation
# verifies trees of 60 tokens, --eagle-tree-size 60). A token's chance of acceptance falls
# geometrically with its depth (at 0.99 per token a 256th is accepted 8% of the time), while the
# goodput policy prices every k up to k_max each step and the draft buffers are sized by it.
MAX_DRAFT_LEVELS = 256
# A tree's nodes at k_max levels, at most: far above any token budget, and small enough that
# branching^(k + 1) stays an exact int64 (numpy's integers wrap around silently).
MAX_TREE_TOKENS = 2**20


# -- theory (Leviathan et al., ICML 2023) -------------------------------------------------------
def expected_tokens_per_step(alpha, k):
    """E[tokens emitted by one verify step] under i.i.d. acceptance: (1 - alpha^(k+1)) / (1 - alpha)."""
    alpha, k = np.asarray(alpha, dtype=float), np.asarray(k, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return np.where(alpha >= 1.0, k + 1, value)


# -- common random numbers -----------------------------------------------------------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection of uint64 that scatters nearby inputs."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hashed_uniforms(key: int, request_ids, positions) -> np.ndarray:
    """U(key, request, position) in [0, 1): the same arguments give the same number, every time."""
    ids = np.asarray(request_ids).astype(np.uint64)
    pos = np.asarray(positions).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = _mix(np.uint64(key) ^ (ids * _GOLDEN))
        z = _mix(z + pos * _GOLDEN + np.uint64(1))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def stream_key(seed: int, purpose: int) -> int:
    """A 64-bit hashing key for one purpose, derived from the scenario seed."""
    return int(np.random.SeedSequence([seed, purpose]).generate_state(1, np.uint64)[0])


# -- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Acceptance:
    """How many of the draft's tokens the target accepts (see the module docstring)."""
    process: AcceptanceProcess = AcceptanceProcess.BERNOULLI
    alpha: float = 0.7                  # bernoulli, positional
    beta_a: float = 0.0                 # beta
    beta_b: float = 0.0
    decay: float = 1.0                  # positional
    samples: tuple[int, ...] = ()       # replay: measured accepted lengths
    measured_k: int = 0                 # replay: the k they were measured at
    predicted_range: tuple[float, float] | None = None   # predicted: alpha's one-sd range (acceptance_model)
    workload: str = WORKLOADS[0]        # predicted: the workload it was predicted for
    distilled: bool = False             # predicted: the draft was distilled from the target
    same_family: bool | None = None     # predicted: as the scenario states it (None: judged from the names)
    path: str | None = None             # replay: the CSV of measured lengths, and its column
    column: str = "accepted"
    measured: bool = False              # the scenario states it (any process but predicted): a measurement
    # beta given as (mean, concentration) rather than (a, b): a key laid over the written scenario then
    # meets the form the file used (the reader takes one form or the other, never both)
    beta_mean_concentration: tuple[float, float] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        members_of(self, process=AcceptanceProcess)

    @property
    def mean_alpha(self) -> float:
        """The acceptance rate a typical token sees (for estimators' priors and reports)."""
        if self.process is AcceptanceProcess.BETA:
            return self.beta_a / (self.beta_a + self.beta_b)
        if self.process is AcceptanceProcess.REPLAY:
            samples = np.asarray(self.samples, dtype=float)
            # MLE of a per-token rate from truncated-geometric lengths: accepted / (accepted + rejections).
            rejections = (samples < self.measured_k).sum()
            return float(samples.sum() / max(samples.sum() + rejections, 1))
        return self.alpha

    def request_alphas(self, key: int, request_ids) -> np.ndarray:
        """Each request's own acceptance rate (the same for all but the ``beta`` process)."""
        ids = np.asarray(request_ids)
        if self.process is AcceptanceProcess.BETA:
            return self.beta_quantiles(hashed_uniforms(key, ids, np.zeros_like(ids)))
        return np.full(len(ids), self.mean_alpha)

    def beta_quantiles(self, q) -> np.ndarray:
        """The ``beta`` process's acceptance rates at quantiles ``q`` of Beta(``beta_a``, ``beta_b``). scipy.stats
        is imported here, where a beta process is first drawn, not with this module (about 0.4 CPU s a process:
        a search without one does not pay it)."""
        from scipy import stats

        return stats.beta.ppf(q, self.beta_a, self.beta_b)

    def accepted(self, key: int, request_ids: np.ndarray, positions: np.ndarray, alphas: np.ndarray,
                 k: np.ndarray) -> np.ndarray:
        """Draft tokens accepted by one verify step of each sequence (0 where ``k`` is 0).

        ``positions`` is each sequence's next output index (its draft token j proposes
        output ``positions + j``); ``k`` its draft length this step.
        """
        out = np.empty(len(k), dtype=np.int64)
        self.draws(key)(request_ids, positions, alphas, k, out)
        return out

    def draws(self, key: int, branching: int = 1, checked: bool = True) -> Callable[
            [np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], int]:
        """:meth:`accepted` as one compiled call with ``key`` and the process's parameters bound
        (the simulator builds it once per engine and calls it every step):
        ``draw(request_ids, positions, alphas, k, out)`` writes the first ``len(out)`` rows'
        accepted prefixes into ``out`` and returns their total. With ``branching`` > 1 the
        draft is a tree and ``k`` its depth (each level accepted with ``1 - (1 - p)^b``).

        ``checked``: through numba's dispatcher, which takes any arrays; False: through the kernels' entry
        points (:class:`_DrawEntryPoints`), for a caller whose arrays are exactly the signatures' C-contiguous
        int64 and float64 columns (the speculative decode set's, every step: about 0.3 us a call less)."""
        key_u64 = np.uint64(key)
        if self.process is AcceptanceProcess.REPLAY:
            samples = np.asarray(self.samples, dtype=np.int64)
            replayed = replayed_prefixes if checked else _DrawEntryPoints.replayed
            return lambda request_ids, positions, alphas, k, out: replayed(key_u64, request_ids, positions, samples, k,
                                                                         out)
        decay = self.draw_decay
        accepted = accepted_prefixes if checked else _DrawEntryPoints.accepted
        return lambda request_ids, positions, alphas, k, out: accepted(key_u64, request_ids, positions, alphas, k,
                                                                     decay, out, branching)

    @property
    def draw_decay(self) -> float:
        """The factor per draft position :func:`~llmsim.speculation.kernels.accepted_prefixes` draws with (1 but
        for the positional process; a replayed process draws otherwise)."""
        return self.decay if self.process is AcceptanceProcess.POSITIONAL else 1.0


class _DrawEntryPoints:
    """The acceptance draws' kernels through their entry points (see llmsim.compiled; the signatures beside the
    kernels in :mod:`llmsim.speculation.kernels`), for :meth:`Acceptance.draws` with ``checked`` False."""
    accepted: EntryPoint[Callable[..., int]] = EntryPoint(accepted_prefixes, ACCEPTED_PREFIXES_SIGNATURE)
    replayed: EntryPoint[Callable[..., int]] = EntryPoint(replayed_prefixes, REPLAYED_PREFIXES_SIGNATURE)


@dataclass(frozen=True)
class KPolicy:
    """How many tokens to draft.

    ``static``: always ``k``. ``adaptive``: start at ``k``; every ``window`` rounds
    look at the acceptance (accepted / proposed draft tokens) over them, k += 1 above
    ``raise_above``, k -= 1 below ``lower_below``, within [1, ``k_max``]; with
    ``fallback`` a k of 1 that still falls below ``lower_below`` turns speculation off
    (k = 0) and retries k = 1 after ``window`` rounds, doubling the time off after each
    retry that fails in a row (exponential back-off, up to 32 windows), so a useless draft
    costs a few probe rounds, not half the steps. ``goodput``: each step
    the k in [0, ``k_max``] with the most expected tokens per second for the batch.
    ``scope`` says whether adaptive k is kept per request or one for the whole batch
    (goodput always chooses one k for the batch, as SmartSpec does).
    """
    policy: KPolicyName = KPolicyName.STATIC
    k: int = 4
    k_max: int = 8                      # the reader's default: at least k (Medusa: its heads)
    scope: KScope = KScope.PER_REQUEST  # the reader's default for goodput: per_batch
    window: int = 10
    raise_above: float = 0.8
    lower_below: float = 0.5
    fallback: bool = True
    prior_alpha: float = 0.7            # goodput: the acceptance assumed before any is observed
    # ``k_max`` and ``scope`` where the scenario gave them (else they follow k and the policy).
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self):
        members_of(self, policy=KPolicyName, scope=KScope)

    @property
    def label(self) -> str:
        """``policy:k``, as tables and recommendations print a k setting."""
        return f"{self.policy}:{self.k}"


@dataclass(frozen=True)
class Eligibility:
    """When a sequence may speculate; the others decode one token in the same batch."""
    min_sequence_tokens: int = 32       # speculate only once prompt + output exceeds this
    min_concurrent_requests: int = 2    # and while at least this many requests are running


@dataclass(frozen=True)
class SpeculationConfig:
    draft: ModelSpec | None             # a draft model or head (HeadSpec); None: an n-gram speculator (no memory)
    placement: DraftPlacement = DraftPlacement.COLOCATED   # draft on the target's devices, or on devices of its own
    draft_tensor_parallel: int | None = None   # colocated: over how many of the target's devices
    draft_devices: int = 0              # separate: devices per replica for the draft (its tp)
    policy: KPolicy = field(default_factory=KPolicy)
    acceptance: Acceptance = field(default_factory=Acceptance)
    eligibility: Eligibility = field(default_factory=Eligibility)
    proposer: Proposer = field(default_factory=Proposer)   # its kind follows ``draft`` unless a head
    scorer: Scorer = Scorer.MQA         # how the target scores a chain (vLLM V0 expanded the batch)
    # ``draft_tensor_parallel`` where the scenario gave it (else it follows the target's).
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self):
        members_of(self, placement=DraftPlacement, scorer=Scorer)
        if self.draft is not None and self.proposer.kind == NGRAM:
            object.__setattr__(self, "proposer", replace(self.proposer, kind=MODEL))

    @property
    def enabled(self) -> bool:
        """A static k of 0 is plain decoding: no draft is loaded at all."""
        return self.policy.policy is not KPolicyName.STATIC or self.policy.k > 0

    @property
    def colocated_draft(self) -> ModelSpec | None:
        return self.draft if self.draft is not None and self.placement is DraftPlacement.COLOCATED else None

    @property
    def extra_devices(self) -> int:
        return self.draft_devices if self.draft is not None and self.placement is DraftPlacement.SEPARATE else 0


def speculation_from_node(node: Node, target: ModelSpec, read_model, tensor_parallel: int | None,
                          pipeline_parallel: int | None, batching: Batching) -> SpeculationConfig:
    """Read ``speculation:``; ``read_model(node, key)`` reads a model the way ``model:`` is read.

    ``tensor_parallel`` and ``pipeline_parallel`` are None when the scenario leaves them to
    placement (auto); an unset draft tensor parallelism is then resolved with them
    (:func:`resolve_draft_parallelism`).
    """
    proposer, draft = _proposer(node, target, read_model)
    count = NumberRange(integer=True, minimum=1, exclusive_minimum=False)
    placement = DraftPlacement(node.choice("placement", DraftPlacement.names(), SpeculationConfig.placement))
    if placement is DraftPlacement.SEPARATE and proposer.kind in HEAD_KINDS:
        raise node.key_error("placement", f"a {proposer.kind} head runs on the target's hidden states, on its devices",
                             placement, "colocated")
    draft_tp = node.number("draft_tensor_parallel", None, **count)   # None: as the target, if it can
    if draft is not None and draft_tp is not None and draft.num_heads % draft_tp:
        raise node.key_error("draft_tensor_parallel", f"must divide the draft's {draft.num_heads} heads", draft_tp,
                             ", ".join(str(d) for d in range(1, draft.num_heads + 1) if draft.num_heads % d == 0))
    if placement is DraftPlacement.COLOCATED and tensor_parallel and draft_tp and draft_tp > tensor_parallel:
        raise node.key_error("draft_tensor_parallel", f"a colocated draft runs on the target's {tensor_parallel} "
                             "device(s)", draft_tp, f"1..{tensor_parallel}")
    draft_devices = node.number("draft_devices", 1, **count) if placement is DraftPlacement.SEPARATE else 0
    if placement is DraftPlacement.SEPARATE and draft is not None and draft.num_heads % draft_devices:
        raise node.key_error("draft_devices", f"the draft runs tensor-parallel over them: must divide its "
                             f"{draft.num_heads} heads", draft_devices, "a divisor of the draft's heads")
    if placement is DraftPlacement.SEPARATE and draft is None:
        node.number("draft_devices", 1, **count)    # read (and ignored): an n-gram speculator has no devices

    policy = read_k_policy(node, proposer)
    k_max = policy.k_max

    acceptance = _acceptance(node.child("acceptance", {}), k_max, proposer, draft, target)
    if proposer.branching > 1 and acceptance.process is AcceptanceProcess.REPLAY:
        raise node.key_error("tree_branching", "replayed accepted lengths were measured on a chain",
                             proposer.branching, "1 with process: replay")
    eligibility = read_eligibility(node.child("eligibility", {}))
    scorer = Scorer(node.choice("scorer", Scorer.names(), SpeculationConfig.scorer))
    if scorer is Scorer.BATCH_EXPANSION and proposer.branching > 1:
        raise node.key_error("scorer", "batch expansion scores a chain of draft tokens, not a tree", scorer,
                             f"{Scorer.MQA}, or tree_branching: 1")
    node.done()
    config = SpeculationConfig(draft, placement, draft_tp, draft_devices, policy, acceptance, eligibility, proposer,
                               scorer,
                               given=frozenset({"draft_tensor_parallel"}) if draft_tp is not None else frozenset())
    if config.enabled and batching is Batching.STATIC:
        raise node.error("speculative decoding needs continuous batching", key=node.path, value=batching,
                         allowed="engine.batching: continuous")
    return config


def read_k_policy(node: Node, proposer: Proposer, default: KPolicy = KPolicy()) -> KPolicy:
    """The k policy keys of ``speculation:`` (``node``) for ``proposer``'s drafts; ``default`` for the keys
    it leaves out but k_max (at least k; Medusa: its heads) and a goodput policy's scope (per batch)."""
    policy_name = KPolicyName(node.choice("policy", KPolicyName.names(), default.policy))
    k = node.number("k", default.k, integer=True, minimum=0, exclusive_minimum=False)
    k_max = node.number("k_max", max(proposer.heads, k) if proposer.kind == MEDUSA else max(KPolicy.k_max, k),
                        integer=True, minimum=1, exclusive_minimum=False)
    if k > k_max:
        raise node.key_error("k", f"exceeds k_max ({k_max})", k, f"0..{k_max}")
    _check_draft_size(node, k_max, proposer.branching)
    if proposer.kind == MEDUSA and k_max > proposer.heads:
        raise node.key_error("k_max" if node.has("k_max") else "k", f"Medusa drafts one token per head "
                             f"({proposer.heads} heads)", k_max, f"k and k_max <= heads ({proposer.heads})")
    if policy_name is KPolicyName.ADAPTIVE and k == 0:
        raise node.key_error("k", "the adaptive rule starts from k0 >= 1", k, f"1..{k_max}")
    goodput = policy_name is KPolicyName.GOODPUT
    scope = KScope(node.choice("scope", KScope.names(), KScope.PER_BATCH if goodput else default.scope))
    if goodput and scope is not KScope.PER_BATCH:
        raise node.key_error("scope", "the goodput policy chooses one k for the whole batch", scope, "per_batch")
    fraction = NumberRange(minimum=0.0, maximum=1.0, exclusive_minimum=False)
    raise_above = node.number("raise_above", default.raise_above, **fraction)
    lower_below = node.number("lower_below", default.lower_below, **fraction)
    if lower_below > raise_above:
        raise node.key_error("lower_below", f"must not exceed raise_above ({raise_above:g})", lower_below,
                             f"0..{raise_above:g}")
    given = frozenset(key for key in ("k_max", "scope") if node.has(key)) | (default.given & {"scope"})
    return KPolicy(policy_name, k, k_max, scope,
                   node.number("window", default.window, integer=True, minimum=1, exclusive_minimum=False),
                   raise_above, lower_below, node.boolean("fallback", default.fallback),
                   node.number("prior_alpha", default.prior_alpha, minimum=0.0, maximum=1.0, exclusive_minimum=True),
                   given)


def read_eligibility(node: Node, default: Eligibility = Eligibility()) -> Eligibility:
    """``speculation.eligibility`` (``node``), ``default`` for the keys it leaves out."""
    eligibility = Eligibility(node.number("min_sequence_tokens", default.min_sequence_tokens, integer=True,
                                          minimum=0, exclusive_minimum=False),
                              node.number("min_concurrent_requests", default.min_concurrent_requests, integer=True,
                                          minimum=1, exclusive_minimum=False))
    node.done()
    return eligibility


def _check_draft_size(node: Node, k_max: int, branching: int) -> None:
    """k_max within :data:`MAX_DRAFT_LEVELS`, and a tree's nodes at k_max within :data:`MAX_TREE_TOKENS`."""
    key = "k_max" if node.has("k_max") else "k"
    if k_max > MAX_DRAFT_LEVELS:
        raise node.key_error(key, f"a draft of {k_max:,} levels is beyond what llmsim models", node.raw(key),
                             f"k and k_max <= {MAX_DRAFT_LEVELS}")
    nodes = sum(branching ** j for j in range(1, k_max + 1))        # Python integers: no overflow
    if nodes > MAX_TREE_TOKENS:
        raise node.key_error(key, f"a tree of {k_max} levels with tree_branching {branching} has {nodes:.3g} nodes "
                                  "to verify per sequence per step", node.raw(key),
                             f"at most {MAX_TREE_TOKENS:,} nodes: fewer levels (k_max) or a smaller tree_branching")


def _proposer(node: Node, target: ModelSpec, read_model) -> tuple[Proposer, ModelSpec | None]:
    """``draft:`` (a model, ``ngram``, ``eagle``, ``mtp`` or ``medusa``) with its own keys:
    ``heads`` (Medusa), ``tree_branching`` (all but n-gram), ``ngram_cpu_per_sequence`` and
    ``ngram_cpu_per_context_token`` (n-gram),
    and the checks that the target can verify the draft's tokens (``allow_larger_draft``,
    ``allow_different_vocabulary`` waive them) and, for ``mtp``, ships the module (``allow_missing_mtp``)."""
    raw = node.raw("draft")
    kind = ProposerKind(raw) if isinstance(raw, str) and raw in ProposerKind.names() else MODEL
    heads = node.number("heads", 4, integer=True, minimum=1) if kind == MEDUSA else 0
    branching = Proposer.branching
    if kind != NGRAM:
        branching = node.number("tree_branching", Proposer.branching, integer=True, minimum=1)
    cpu_s = (node.quantity("ngram_cpu_per_sequence", "duration", Proposer.cpu_s_per_sequence,
                           exclusive_minimum=False) if kind == NGRAM else 0.0)
    per_token_s = (node.quantity("ngram_cpu_per_context_token", "duration", NGRAM_CPU_S_PER_CONTEXT_TOKEN,
                                 exclusive_minimum=False) if kind == NGRAM else 0.0)
    proposer = Proposer(kind, heads, branching, cpu_s, per_token_s)
    if kind == NGRAM:
        return proposer, None
    allow_missing_mtp = node.boolean("allow_missing_mtp", False) if kind == MTP else False
    if kind == MTP and not target.mtp_modules and not allow_missing_mtp:
        raise node.key_error("draft", f"{target.name} ships no multi-token-prediction module (mtp_modules: 0, "
                             "config.json's num_nextn_predict_layers); nothing would draft", raw,
                             f"a target with MTP modules (DeepSeek-V3), another proposer ({EAGLE}, {MEDUSA}, "
                             f"{NGRAM}, a draft model), or allow_missing_mtp: true (an MTP module you trained)")
    if kind in HEAD_KINDS:
        return proposer, head_spec(kind, target, heads)
    draft = read_model(node, "draft")
    allow_vocabulary = node.boolean("allow_different_vocabulary", False)
    allow_larger = node.boolean("allow_larger_draft", False)
    if draft.vocab_size != target.vocab_size and not allow_vocabulary:
        raise node.key_error("draft", f"the draft's vocabulary ({draft.vocab_size:,}) differs from the target's "
                             f"({target.vocab_size:,}); the target cannot verify its tokens", raw,
                             f"a model with a {target.vocab_size:,}-token vocabulary, {NGRAM}, a head "
                             f"({', '.join(HEAD_KINDS)}), or allow_different_vocabulary: true (token translation "
                             "between vocabularies, whose acceptance you then give)")
    if draft.param_count >= target.param_count and not allow_larger:
        raise node.key_error("draft", f"the draft ({draft.param_count / 1e9:.2f}B parameters) is not smaller than "
                             f"the target {target.name} ({target.param_count / 1e9:.2f}B): it cannot save time", raw,
                             "a smaller model, or allow_larger_draft: true")
    return proposer, draft


def resolve_draft_parallelism(config: SpeculationConfig, tensor_parallel: int) -> SpeculationConfig:
    """A colocated draft shards like the target when its heads allow, else runs on one device."""
    if config.draft_tensor_parallel is not None:
        return config
    draft = config.draft
    tp = tensor_parallel if draft is not None and draft.num_heads % tensor_parallel == 0 else 1
    return replace(config, draft_tensor_parallel=tp)


def same_family(draft: ModelSpec, target: ModelSpec) -> bool:
    """Same vocabulary and the same name up to the major version ("Llama-3.2-1B" and "Llama-3.1-70B")."""
    stem = re.compile(r"[A-Za-z]+[-_ ]?\d*")
    first, second = stem.match(draft.name), stem.match(target.name)
    return (draft.vocab_size == target.vocab_size and first is not None and second is not None
            and first.group(0).lower() == second.group(0).lower())


def predicted_acceptance(proposer: Proposer, draft: ModelSpec | None, target: ModelSpec, workload: str = "chat",
                         distilled: bool = False, family: bool | None = None) -> Estimate:
    """The acceptance model's estimate for this draft (or head, or lookup) and target."""
    if proposer.kind != MODEL:
        return default_model().predict(proposer.kind, workload)
    assert draft is not None, "a draft-model proposer has a draft"
    return default_model().predict(MODEL, workload, draft.param_count, target.param_count, distilled,
                                   same_family(draft, target) if family is None else family, draft.weight_dtype)


def _acceptance(node: Node, k_max: int, proposer: Proposer, draft: ModelSpec | None, target: ModelSpec) -> Acceptance:
    stated = bool(node.data)
    process = AcceptanceProcess(node.choice("process", AcceptanceProcess.names(), AcceptanceProcess.BERNOULLI))
    if process is AcceptanceProcess.PREDICTED:
        # From the draft/target pair and the workload (acceptance_model); a measured alpha, beta or
        # replay in place of ``predicted`` overrides it.
        stated_family = family = None
        if proposer.kind == MODEL and draft is not None:
            stated_family = node.boolean("same_family") if node.has("same_family") else None
            family = same_family(draft, target) if stated_family is None else stated_family
        workload = node.choice("workload", WORKLOADS, WORKLOADS[0])
        distilled = node.boolean("distilled", Acceptance.distilled)
        estimate = predicted_acceptance(proposer, draft, target, workload, distilled, family)
        node.done()
        return Acceptance(process, alpha=estimate.alpha, predicted_range=(estimate.low, estimate.high),
                          workload=workload, distilled=distilled, same_family=stated_family)
    prob = NumberRange(minimum=0.0, maximum=1.0, exclusive_minimum=False)
    if process in (AcceptanceProcess.BERNOULLI, AcceptanceProcess.POSITIONAL):
        alpha = node.number("alpha", Acceptance.alpha, minimum=0.0, maximum=1.0, exclusive_minimum=False)
        decay = node.number("decay", 0.9, **prob) if process is AcceptanceProcess.POSITIONAL else 1.0
        node.done()
        return Acceptance(process, alpha=alpha, decay=decay, measured=stated)
    if process is AcceptanceProcess.BETA:
        # Either the shape parameters, or a mean and a concentration (a + b); Beta(a, b) needs a, b > 0.
        positive = NumberRange(minimum=0.0, exclusive_minimum=True)
        if node.has("mean") or node.has("concentration"):
            mean = node.number("mean", Acceptance.alpha, minimum=0.0, maximum=1.0, exclusive_minimum=True)
            if mean >= 1.0:
                raise node.key_error("mean", "must be below 1", mean, "0 < mean < 1")
            concentration = node.number("concentration", 10.0, **positive)
            node.done()
            return Acceptance(process, beta_a=mean * concentration, beta_b=(1 - mean) * concentration,
                              measured=stated, beta_mean_concentration=(mean, concentration))
        a, b = node.number("a", **positive), node.number("b", **positive)
        node.done()
        return Acceptance(process, beta_a=a, beta_b=b, measured=stated)
    path = node.path_value("path")
    column = node.string("column", "accepted")
    measured_k = node.number("measured_k", integer=True, minimum=1, exclusive_minimum=False)
    node.done()
    if measured_k < k_max:
        raise node.key_error("measured_k", f"lengths measured at k = {measured_k} cannot say what a longer "
                             f"draft (k_max = {k_max}) would get accepted", measured_k,
                             f"an integer >= k_max ({k_max}), or a smaller k_max")
    frame = read_csv(path, node, "path")
    if column not in frame.columns:
        raise node.key_error("column", f"no such column in {path.name}", column, ", ".join(map(str, frame.columns)))
    values = pd.to_numeric(frame[column], errors="coerce")
    bad = values.isna() | (values < 0) | (values > measured_k) | (values % 1 != 0)
    if bad.any() or len(values) == 0:
        first = frame[column][bad].iloc[0] if bad.any() else "(empty)"      # the cell's text
        number = values[bad].iloc[0] if bad.any() else float("nan")
        if number == number and float(number).is_integer():
            first = int(number)                                           # 9, not '9', in the message
        raise node.key_error("column", f"accepted lengths must be integers in 0..{measured_k} "
                             f"(row {int(np.argmax(bad.to_numpy())) + 2} of {path.name} is not)" if bad.any()
                             else f"{path.name} has no rows", first, f"integers 0..{measured_k}")
    return Acceptance(process, samples=tuple(int(v) for v in values), measured_k=measured_k, measured=stated,
                      path=str(path), column=column)
