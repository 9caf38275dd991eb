"""Recommended engine settings: draft length k, max batch tokens and queue timeout under the SLO.

The objective is goodput in the DistServe sense: the highest arrival rate at which the
deployment still meets every SLO percentile target (``slo.met``: P95 TTFT <= ttft and so
on, see :class:`~llmsim.scenario.scenario.SLO`), with its output tokens per second; or, with
``objective="cost"``, the dollars per million output tokens when serving at that rate
(it differs from goodput's ranking when a draft on devices of its own adds devices).
A recommendation must also meet the targets at the scenario's own rate.

The search (:func:`recommend`):

1. **Coarse grid, analytic.** Every combination of k (off; static 1..k_max; the
   adaptive 80/50 rule from k0 = 4 up to k_max 8, both held to what the proposer can draft:
   Medusa one token per head) and max batch tokens (powers of two, the scenario's
   own and the rule of thumb) is scored by the fluid model (:mod:`llmsim.analysis.fluid`; a disaggregated
   deployment's is its pools' and link's, :mod:`llmsim.analysis.fluid_disaggregated`): its
   highest rate with mean TTFT, TPOT and E2E within the limits. Queue timeouts are
   invisible to it (they act on the tail), so they are left to the simulator. Only the best ``top``
   are simulated, so a setting's scan stops once it shows the setting's rate below the ``top``-th best
   of those scored before it (:meth:`_Search.screen_grid`; ``screened_out`` in the table, its rate not
   known): the best ``top`` are the whole grid's, with the same rates.
2. **Simulated, repeated seeds.** The best ``top`` of them, and the rule-of-thumb
   defaults, get their highest passing rate by bisection on the rate, separately for
   each seed (common random numbers: every configuration sees a seed's requests), run
   in parallel through :func:`llmsim.search.sweeps.run_points`. A setting that fails at the
   scenario's own rate cannot be recommended, and its search stops there.
   With ``drafts=True`` on a speculating scenario, every proposer the target can verify (catalog
   drafts in their dtype and at fp8, an EAGLE head, an MTP module where the target ships one, n-gram
   lookup, and drafts of 20-30% of the target's parameters made of its own first layers) is screened
   at Theorem 3.8's k by the fluid model's goodput across loads (:func:`_draft_screen`); the best
   :data:`DRAFT_TOP` and the best one inside the 20-30% band (bisected to the end: the practice rule
   is judged on it) are simulated with the rest.
   A probe the window leaves undecided is measured longer only while its estimate passes
   (:mod:`llmsim.search.window`): the goodput rests on rates shown to pass as before, and a fail
   taken on its estimate can only lower it. A probe's window is the window rule's alone, without the
   scenario's own request count as a floor (each verdict carries its standard error, and is measured
   longer while undecided); under a diurnal arrival it measures whole cycles, and a scenario whose cycle at
   its own rate is longer than one run may simulate is refused before any search
   (:func:`llmsim.search.window.check_cycle_fits`).
   Each setting's bisection starts from the fluid model's rate scaled by the simulated/fluid ratio of the
   settings simulated so far; where none is yet (the search's first settings), the first of them is a
   *pilot*, bisected alone on its first seed, and its ratio starts the others. A setting is bisected on its
   first seed first; each other seed is then simulated first at that seed's failing rate, then (where it
   failed there) at its passing rate, and goes on from there like any bisection: where its capacity lies in
   the first seed's bracket two runs settle it, and wherever it lies, its answer is a rate it passed with a
   failing rate within ``tolerance`` above, as before (only where the bracket starts moves). A bracket that
   starts from such information (a ratio observed on simulated settings, a first seed's bracket, a leader's)
   moves by ``tolerance`` until it brackets, so that a start near the answer ends it with no bisection; one
   that starts from the fluid model alone moves by 20%.
   The analytic best, the first default and the proposers are bisected first; the other settings, here and
   in the later steps, are then *challengers* of the leader (the first row so far, bisected to the end; for a
   default, the best default): each seed is simulated first at the leader's failing rate for that seed, then
   where it failed there at the leader's passing rate (the same requests), and a challenger whose failing
   rates average at or below the leader's stops there: it cannot be shown better than the leader by more
   than the leader's own bracket, and the leader keeps its rank. Its run at the leader's failing rate is
   measured over one window, not longer while undecided: a pass that window leaves undecided counts as a
   fail there (the challenger's capacity then lies within the window's resolution of a rate the leader
   failed: a tie, which measuring it up to 15 windows longer would only confirm), so only a decided pass
   there keeps a challenger going.
   The bisections race: a setting whose failing rates average at or below the passing rates of another
   that meets the scenario's rate can no longer rank first, and stops (``raced_out``; its goodput is
   then a lower bound, or, where it never passed, 0 and known only to lie below ``failing_rate_per_s``).
   Runs that differ only in a queue timeout none of their requests waited for are one run
   (:func:`llmsim.search.sweeps.reusing_runs`).
3. **Local refinement.** Around the best so far: k +- 1, max batch tokens x2 and /2,
   and each queue timeout (50, 200, 1000 ms), simulated the same way.
   A disaggregated deployment whose two pools each set their own max batch tokens never runs the engine
   block's: every value of it simulates the same runs, so it is not searched (the grid, the defaults and the
   refinement hold the scenario's; :func:`batch_tokens_held`), nor is it under a controller that moves it. With
   prefix caching
   also the KV block size /2 and x2 (it trades hit rate against fragmentation), and with
   CPU offload each idle timeout of :data:`IDLE_TIMEOUTS_S` (the fluid model sees neither). With
   drafts searched and a speculating best, each eligibility rule (min_sequence_tokens 0 or the
   scenario's, min_concurrent_requests 1 or the scenario's): the proposer, k policy and eligibility
   of the answer come from this one search (:class:`DraftSearch`).
   With a mixture-of-experts model (aggregated, one pipeline stage), **the expert-parallel degree**
   (:meth:`_Search.experts`): the best setting so far at degree 1 (experts tensor parallel) and at each
   degree ``tp x 2^i`` that splits the experts (:func:`llmsim.search.layout.expert_degrees`; the attention
   then runs data parallel over ``degree / tp`` ranks, the DeepSeek layout), with the scenario's other
   ``expert_parallel`` settings; a degree that is no valid layout (does not fit, a group wider than a node
   without a scale-out bandwidth) is reported as such. The degrees change the devices a replica takes, so
   goodput alone would favour the widest: each is bisected to the end and the degree chosen is the cheapest
   per million output tokens at its goodput among those meeting the targets at the scenario's rate
   (:class:`ExpertSearch` says which and why); the settings at that degree then rank first, whatever the
   objective.
4. **Traffic classes: the policy and every class's timeout, jointly** (:meth:`_Search.classes`).
   Bisecting the rate of every (policy, timeout per class) combination would cost
   6 x 5^classes searches; instead, with the best setting's other knobs held, every
   combination visited is *screened*: simulated once per seed at one probe rate, the
   highest of the scenario's and the best setting's goodput (where the best only just
   passes, so a better setting shows as a larger margin), on the same requests for every
   candidate (common random numbers: the knobs leave the trace unchanged), over a bisection
   probe's window (so each policy's best starts its bisection on the runs it was screened with),
   and ranked by whether it meets every class's targets there and then by its worst class margin
   (attainment minus target, pooled over seeds; :func:`llmsim.search.window.judge`). A run sure to
   miss a class's target stops there (:mod:`llmsim.sim.missed`, each class's own limits): such a
   candidate misses by more than the stop's margin and ranks below every one that misses without
   stopping (:func:`_screen_key`). For
   each scheduling policy, coordinate descent over the classes: each class's timeout in
   turn is set to the best of :data:`CLASS_TIMEOUTS_S` (or those asked for; and the class's own) with the
   others held, all policies at once, for up to :data:`CLASS_SWEEPS` sweeps or until no
   class moves; a candidate screened once is never simulated again, nor is one whose timeouts
   differ from a screened candidate's only where neither timeout was reached by its class's
   longest wait in that run (the same run: :func:`llmsim.search.sweeps.reusing_runs`; the
   longest timeout of a class's options runs first), nor one under another of FCFS, priority, vLLM's priority
   and EDF where a run without preemptions shows the two order the classes' heads alike within its waits
   (:func:`llmsim.sim.scheduling.same_admissions`). A candidate must beat its policy's current setting to be
   chosen: its seeds run one at a time, those on which that setting fell shortest of its worst target first (its
   neighbours run on the same requests, so they tend to fall short there too), and it stops once even the best
   runs its other seeds could give (every request within every limit: :func:`llmsim.search.window.best_case`)
   leave it below that setting's screen; a run after its first seed's also stops inside, once its requests
   already sure to miss a limit leave it there whatever the rest of the run shows (:class:`BarStop`). Exact:
   its screen on every seed could not have been chosen, and the runs that go to their end are those the
   search would have run. Each policy's best
   combination then gets its goodput bisected like any other setting (starting at the probe
   rate), and takes part in the final ranking. ``search="classes"`` runs this step alone,
   from the scenario's own settings (which are then the baseline the gain is measured against).

The answer is the configuration with the best mean over seeds, with a 95% Student-t
confidence interval across seeds, re-simulated at the scenario's rate for its
predicted latencies. Rule-of-thumb defaults: k from the 80/50 rule starting at 4 with
k_max 8; max batch tokens from the seed's rule memory / (2 x params + KV): the memory left after
the weights at 2 bytes per parameter holds (memory - 2 x params) / KV bytes per token, read as the tokens a
step carries when the requests that memory holds at the mean context (at most ``max_num_seqs``) are
in flight: each emits one token a step and brings its prompt over its output steps, so
sequences x (1 + mean prompt / mean output) (:class:`BatchTokenRule`); queue timeouts 50, 200 and 1000 ms
(the best of the three is the one beaten). The first is bisected to the end and the others are its challengers
(one that does no better stops at its first failing run per seed); the shortest goes first, as it wins where
the timeouts do not tie (longest first cost the canary and report searches 15-17% more CPU and saved the
disaggregated 70B's 14%).

A trace replayed as it is (no ``sample:``) and no speculation leaves nothing to the seed:
every seed would simulate the same requests the same way, and their spread, zero, is no
confidence interval. Such a search runs one replication, and its intervals are NaN
("not available"), never a false zero (:func:`replays_one_trace`).
"""
from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from llmsim.analysis import names
from llmsim.config.policies import ControllerKnob, KPolicyName, Objective, SchedulingPolicy, SearchScope
from llmsim.config.progress import QUIET, Progress
from llmsim.analysis.fluid import FluidModel, has_length_law
from llmsim.analysis.fluid_disaggregated import DisaggregatedFluid, fluid_model
from llmsim.analysis.statistics import ci95_half_width
from llmsim.errors import ConfigError
from llmsim.search.plan import as_scenario, check_rate_driven
from llmsim.scenario.scenario import Scenario
from llmsim.scenario.variants import RATE_KEY, variant, with_requests
from llmsim.search.layout import MAX_EXPERT_PARALLEL, expert_degrees, expert_overrides
from llmsim.search.draft_choice import (Candidate, candidate_overrides, candidates, cost_ratio, in_band,
                                       in_band_candidates, theorem_3_8, with_candidate)
from llmsim.search.sweeps import missed_stop, reusing_runs, run_points, slo_met, stopping_missed_runs
from llmsim.search.window import (DECIDED_FAIL, ESCALATIONS, Judged, Verdict, Window, best_case, binding_targets,
                                  check_cycle_fits, judge, limit_checks, measurement_window,
                                  simulate_until_decided, stopping_decided_runs, typical_latency_s)
from llmsim.sim.missed import MissedStop
from llmsim.speculation.acceptance_model import WORKLOADS
from llmsim.speculation.config import KPolicy
from llmsim.speculation.policies import AdaptiveK
from llmsim.speculation.proposers import MODEL
from llmsim.workload.generate import generate_trace

SEEDS, TOP = 3, 3                     # seeds per setting; analytic best settings to simulate
TIMEOUTS_S = (0.05, 0.2, 1.0)       # the defaults' queue timeouts, shortest first (module docstring)
IDLE_TIMEOUTS_S = (0.5, 2.0, 10.0)    # CPU offload: how long a cached block idles before it moves to host memory
BLOCK_SIZES = (16, 512)               # the smallest and largest KV block size tried
RULE_K0, RULE_K_MAX = 4, 8
DRAFT_TOP = 2                         # proposers simulated, best by the fluid model (besides the 20-30% rule's)
CLASS_TIMEOUTS_S = (0.025, 0.05, 0.2, 1.0, 5.0)   # per class: practice's three, one shorter, one longer
CLASS_SWEEPS = 2                      # coordinate-descent sweeps over the classes, at most
MAX_CLASS_TIMEOUTS, MAX_CLASS_TIMEOUT_S = 20, 3600.0   # what class_timeouts_s may hold
FLUID_CHUNK = 8                       # rates the fluid scan solves at once (analytic_rate)


@dataclass(frozen=True)
class KChoice:
    """The speculation a configuration tries: off, the scenario's own settings left as they are
    (``as_in_scenario``), or a k policy from ``k`` (the static k, or the adaptive rule's k0).
    ``str()`` is how tables show it: ``off``, ``as in the scenario``, ``static:3``, ``adaptive:4``."""
    policy: KPolicyName | None = None
    k: int = 0
    as_in_scenario: bool = False

    def __str__(self) -> str:
        if self.as_in_scenario:
            return "as in the scenario"
        return "off" if self.policy is None else KPolicy(self.policy, self.k).label


OFF, SCENARIO_K = KChoice(), KChoice(as_in_scenario=True)


@dataclass(frozen=True)
class Config:
    """One setting of the searched knobs."""
    k: KChoice
    max_batch_tokens: int
    queue_timeout_s: float | None
    block_size: int | None = None        # None: the scenario's own (searched only with prefix caching)
    idle_timeout_s: float | None = None  # None: the scenario's own (searched only with CPU offload)
    # With traffic classes (None: the scenario's own): the scheduling policy, and (class, queue timeout s;
    # None where the class has none, which is left so).
    policy: SchedulingPolicy | None = None
    class_timeouts: tuple[tuple[str, float | None], ...] | None = None
    # With drafts searched: the proposer (None: the scenario's own) and the eligibility rule as
    # (min_sequence_tokens, min_concurrent_requests) (None: the scenario's own, or the candidate's).
    draft: Candidate | None = None
    eligibility: tuple[int, int] | None = None
    # With a mixture-of-experts model: the routed experts' expert-parallel degree (None: the scenario's own; 1:
    # tensor parallel like the rest).
    expert_parallel: int | None = None

    def overrides(self, scenario: Scenario) -> dict:
        point = candidate_overrides(self.draft, scenario) if self.draft is not None and self.k != OFF else {}
        timeout = None if self.queue_timeout_s is None else f"{self.queue_timeout_s * 1000:g} ms"
        point |= {"engine.max_batch_tokens": self.max_batch_tokens, "engine.queue_timeout": timeout}
        if self.block_size is not None:
            point["engine.block_size"] = self.block_size
        if self.idle_timeout_s is not None:      # a mapping: merged into the scenario's, or replacing `true`
            point["engine.cpu_offload"] = {"idle_timeout": f"{self.idle_timeout_s:g} s"}
        if self.policy is not None:
            point["engine.scheduling_policy"] = self.policy
        for name, timeout_s in self.class_timeouts or ():
            if timeout_s is not None:
                point[f"workload.classes.{name}.queue_timeout"] = f"{timeout_s * 1000:g} ms"
        if self.k.as_in_scenario:
            pass
        elif self.k.policy is None:
            if scenario.speculation is not None:
                point["speculation"] = None
        else:
            policy, k = self.k.policy, self.k.k
            assert scenario.speculation is not None       # a k to set: the search speculates only where it may
            k_max = max(scenario.speculation.policy.k_max, k, RULE_K_MAX if policy is AdaptiveK.name else 0)
            k_max = min(k_max, longest_draft(scenario) if self.draft is None else self.draft.k_max)
            point.update({"speculation.policy": str(policy), "speculation.k": k, "speculation.k_max": k_max})
        if self.expert_parallel is not None:
            point |= expert_overrides(self.expert_parallel, scenario.deployment.expert_parallel is not None)
        if self.eligibility is not None and self.k != OFF:
            point["speculation.eligibility"] = {"min_sequence_tokens": self.eligibility[0],
                                                "min_concurrent_requests": self.eligibility[1]}
        return point

    @property
    def label(self) -> str:
        timeout = "none" if self.queue_timeout_s is None else f"{self.queue_timeout_s * 1000:g} ms"
        label = f"k {self.k}, max_batch_tokens {self.max_batch_tokens}, queue timeout {timeout}"
        if self.block_size is not None:
            label += f", block_size {self.block_size}"
        if self.idle_timeout_s is not None:
            label += f", idle timeout {self.idle_timeout_s:g} s"
        if self.policy is not None:
            label += f", policy {self.policy}"
        if self.class_timeouts:
            label += ", class timeouts " + ", ".join(f"{name} {timeout_text(t)}" for name, t in self.class_timeouts)
        if self.draft is not None and self.k != OFF:
            label += f", draft {self.draft.label}"
        if self.eligibility is not None and self.k != OFF:
            label += (f", eligibility min_sequence_tokens {self.eligibility[0]}, "
                      f"min_concurrent_requests {self.eligibility[1]}")
        if self.expert_parallel is not None:
            label += f", expert_parallel {self.expert_parallel}"
        return label


def timeout_text(timeout_s: float | None) -> str:
    return "none" if timeout_s is None else f"{timeout_s * 1000:g} ms"


@dataclass
class ClassSearch:
    """The joint search over the scheduling policy and each class's queue timeout (step 4)."""
    probe_rate_per_s: float          # where every candidate was screened
    timeouts_s: tuple[float, ...]    # the queue timeouts tried for each class (and its own)
    sweeps: int                      # coordinate-descent sweeps run
    # every candidate screened: policy, timeouts, verdict there, on ``seeds`` seeds; ``ruled_out``: its screen on
    # every seed could not have been chosen, shown on fewer seeds or by a run stopped below its bar, whose figures
    # cover only part of it (:meth:`_Search.screen`)
    screened: pd.DataFrame
    best_per_policy: dict            # policy -> its best Config, goodput then bisected


def own_degree(scenario: Scenario) -> int:
    """The scenario's expert-parallel degree (1: its experts tensor parallel like the rest)."""
    experts = scenario.deployment.expert_parallel
    return 1 if experts is None else experts.degree


def searches_experts(scenario: Scenario) -> bool:
    """Whether the search compares expert-parallel degrees (step 3b): a mixture-of-experts model, aggregated
    (a disaggregated deployment's pools set their own), at one pipeline stage (expert-parallel layouts have one)."""
    return (scenario.model.num_experts > 1 and scenario.disaggregation is None
            and scenario.deployment.pipeline_parallel == 1)


def choose_degree(table: pd.DataFrame, own: int) -> int:
    """The expert-parallel degree of ``table`` (:class:`ExpertSearch`'s) that meets the SLO at the scenario's
    rate for the fewest dollars per million output tokens (the fewer GPUs per replica among equals); ``own``
    when none does."""
    meeting = table[(table["refused"] == "") & table["meets_scenario_rate"]]
    if meeting.empty:
        return own
    return int(meeting.sort_values(["usd_per_million_output_tokens", "devices_per_replica"],
                                   kind="stable")["expert_parallel"].iloc[0])


@dataclass
class ExpertSearch:
    """Step 3b: the best setting at each expert-parallel degree and the degree chosen, on cost under the SLOs.

    ``table``: one row per degree: ``expert_parallel``, ``data_parallel`` (attention data-parallel ranks of a
    group), ``devices_per_replica``, goodput and its interval, dollars per million output tokens at that
    goodput, whether it meets the SLO at the scenario's rate, and ``refused`` (why the degree is no valid
    layout, e.g. it does not fit; empty otherwise)."""
    table: pd.DataFrame
    chosen: int
    own: int                     # the scenario's degree, which the rest of the search ran at

    def text(self) -> str:
        lines = ["expert parallelism: the recommended setting at each degree (a replica is a group of that many "
                 "GPUs, degree / tp attention data-parallel ranks; degree 1: the experts tensor parallel), chosen "
                 "on cost per output token at each degree's goodput, among those meeting the SLO at the scenario's "
                 "rate:"]
        for row in self.table.itertuples():
            head = f"  EP {row.expert_parallel:<4d}" + (" (the scenario's)" if row.expert_parallel == self.own else "")
            if row.refused:
                lines.append(f"{head} not a layout here: {row.refused}")
                continue
            lines.append(f"{head} {int(row.data_parallel)} data-parallel ranks, "
                         f"{int(row.devices_per_replica)} GPUs per replica: goodput {row.max_rate_per_s:.3g}"
                         f"{plus_minus(row.max_rate_per_s_ci95)} req/s, "
                         f"${row.usd_per_million_output_tokens:.3g} per million output tokens"
                         + ("" if row.meets_scenario_rate else ", misses the SLO at the scenario's rate"))
        lines.append(f"  chose EP {self.chosen}: {self.reason()}")
        if self.chosen != self.own:
            lines.append(f"  (the settings recommended are at EP {self.chosen}; the rule-of-thumb defaults they are "
                         f"compared with ran at the scenario's EP {self.own})")
        return "\n".join(lines)

    def reason(self) -> str:
        """Why the chosen degree: its cost against the next cheapest degree meeting the SLO, or that no other
        meets it."""
        rows = self.table[self.table["refused"] == ""].set_index("expert_parallel")
        chosen = rows.loc[self.chosen]
        if not chosen["meets_scenario_rate"]:
            return "no degree meets the SLO at the scenario's rate; the scenario's own is kept"
        rivals = rows[rows["meets_scenario_rate"] & (rows.index != self.chosen)]
        missing = [str(d) for d in rows.index[~rows["meets_scenario_rate"]]]
        miss = f"; EP {', '.join(missing)} miss{'es' if len(missing) == 1 else ''} the SLO there" if missing else ""
        if rivals.empty:
            return f"the only degree meeting the SLO at the scenario's rate{miss}"
        runner = rivals.sort_values("usd_per_million_output_tokens").iloc[0]
        more = runner["usd_per_million_output_tokens"] / chosen["usd_per_million_output_tokens"] - 1
        return (f"the cheapest per output token meeting the SLO (${chosen['usd_per_million_output_tokens']:.3g} per "
                f"million); the next, EP {runner.name}, costs {100 * more:.0f}% more "
                f"(${runner['usd_per_million_output_tokens']:.3g}){miss}")


def plus_minus(ci: float) -> str:
    """`` +- ci`` (two significant figures), or nothing where the interval is undefined."""
    return "" if math.isnan(ci) else f" +- {ci:.2g}"


@dataclass
class Recommendation:
    best: Config
    table: pd.DataFrame            # every simulated configuration, best first
    defaults: pd.DataFrame         # the rule-of-thumb rows of the table
    at_scenario_rate: pd.DataFrame  # the best and the best default, re-simulated at the scenario's rate
    objective: Objective
    improvement: float             # best over the best default (goodput ratio - 1, or cost saving)
    improvement_ci95: float        # half-width across seeds, paired, at least the bisection's resolution
    analytic: pd.DataFrame         # the coarse grid as scored by the fluid model (screened_out: below the best top)
    runtime_s: float
    drafts: DraftSearch | None = None   # with drafts=True on a speculating scenario: proposer and eligibility
    search: SearchScope = SearchScope.ALL
    # With traffic classes: the joint class search, and per scheduling policy its best class timeouts, their
    # goodput and each class's attainment at the scenario's rate (best first): why the policy won.
    classes: ClassSearch | None = None
    policies: pd.DataFrame | None = None
    experts: ExpertSearch | None = None     # a mixture-of-experts model: the expert-parallel degree (step 3b)

    @property
    def gain_verdict(self) -> str:
        """Whether the gain over the rule of thumb is significant, in words (a goodput gain is, when its
        95% interval excludes 0; a cost saving or a single replication has no interval)."""
        what = "goodput gain" if self.objective is Objective.GOODPUT else "cost saving"
        if not math.isfinite(self.improvement_ci95):
            return f"the {what} has no interval (one replication): not shown to be significant"
        if abs(self.improvement) > self.improvement_ci95:
            return f"the {what} is significant (its 95% interval excludes 0)"
        return (f"the {what} is not significant (its 95% interval includes 0): the recommended settings are not "
                "shown to beat the rule of thumb; more seeds (--seeds) would tell")


@dataclass(frozen=True)
class BatchTokenRule:
    """The seed's max-batch-tokens rule, memory / (2 x params + KV), read as a token budget per step.

    The memory left after the weights at 2 bytes per parameter holds ``kv_pool_tokens`` tokens of KV
    ((memory - 2 x params) / KV bytes per token); at the workload's mean context (prompt + half the
    output) that is ``sequences`` requests in flight, at most ``max_num_seqs``. At that concurrency the
    engine emits one token per sequence a step and, to keep the pool full, admits as many prompt tokens
    a step as the finishing requests free: each request's prompt spread over its output steps. So a step
    carries ``sequences x (1 + mean prompt / mean output)`` tokens on average, and the rule gives that
    budget (at least ``max_num_seqs``, at most ``max_model_len``). Read literally, the KV pool alone
    (hundreds of thousands of tokens) is always cut to ``max_model_len``: no budget at all."""
    kv_pool_tokens: float
    sequences: float
    prompt_over_output: float
    tokens: int

    def text(self) -> str:
        return (f"(memory - 2 x params) / KV per token = {self.kv_pool_tokens:,.0f} tokens of KV, "
                f"{self.sequences:.0f} requests in flight at the mean context, x (1 + prompt/output "
                f"{self.prompt_over_output:.2f}) = {self.tokens} tokens a step")


def batch_token_rule(scenario: Scenario) -> BatchTokenRule:
    """The rule of thumb for max batch tokens (:class:`BatchTokenRule`)."""
    dep, model, eng = scenario.deployment, scenario.model, scenario.engine
    memory = scenario.hardware.memory_capacity_bytes * eng.memory_utilization * dep.devices_per_replica
    pool = max((memory - 2 * model.param_count) / model.kv_bytes_per_token, 0.0)
    trace = generate_trace(scenario.workload, scenario.seed)
    prompt, output = float(np.mean(trace.prompt_tokens)), float(np.mean(trace.output_tokens))
    sequences = min(pool / (prompt + output / 2), eng.max_num_seqs)
    tokens = sequences * (1 + prompt / output)
    return BatchTokenRule(pool, sequences, prompt / output,
                          int(min(max(tokens, eng.max_num_seqs), scenario.max_model_len)))


def rule_of_thumb_max_batch_tokens(scenario: Scenario) -> int:
    """The rule's budget (:func:`batch_token_rule`)."""
    return batch_token_rule(scenario).tokens


def longest_draft(scenario: Scenario) -> int:
    """The most tokens the scenario's proposer can draft a step: Medusa one per head, else no
    bound (a large number). The adaptive rule's k0 and k_max are held to it."""
    assert scenario.speculation is not None                # asked only of a speculating scenario
    return scenario.speculation.proposer.max_k or 2 ** 31


def rule_k(scenario: Scenario) -> KChoice:
    """The rule-of-thumb k setting: off, or the adaptive 80/50 rule from k0 = 4 (fewer where the
    proposer cannot draft 4 tokens)."""
    if scenario.speculation is None:
        return OFF
    return KChoice(KPolicyName.ADAPTIVE, min(RULE_K0, longest_draft(scenario)))


def k_options(scenario: Scenario) -> list[KChoice]:
    if scenario.speculation is None:
        return [OFF]
    k_max = scenario.speculation.policy.k_max
    return [OFF] + [KChoice(KPolicyName.STATIC, k) for k in range(1, k_max + 1)] + [rule_k(scenario)]


def batch_tokens_held(scenario: Scenario) -> str | None:
    """Why the search holds the scenario's max batch tokens, or None where it searches them. A disaggregated
    deployment whose pools each set their own never runs the engine block's (every value simulates the same
    runs); under a controller that moves it, the value set is only where the controller starts (a setting the
    controller overrides within one interval is not one to recommend)."""
    controller = scenario.controller
    if controller is not None and controller.knob is ControllerKnob.MAX_BATCH_TOKENS:
        return "the controller moves it within its bounds"
    split = scenario.disaggregation
    if split is not None and all(pool.engine.max_batch_tokens is not None for pool in (split.prefill, split.decode)):
        return "each pool of the disaggregated deployment sets its own"
    return None


def searches_batch_tokens(scenario: Scenario) -> bool:
    """Whether the search varies max batch tokens (:func:`batch_tokens_held`)."""
    return batch_tokens_held(scenario) is None


def batch_token_options(scenario: Scenario) -> list[int]:
    eng = scenario.engine
    if not searches_batch_tokens(scenario):
        return [eng.max_batch_tokens]
    powers = [2 ** p for p in range(9, 15)]
    options = set(powers) | {eng.max_batch_tokens, rule_of_thumb_max_batch_tokens(scenario)}
    return sorted(m for m in options if m >= eng.max_num_seqs)


def analytic_rate(scenario: Scenario, trace=None, floor_per_s: float = -math.inf) -> float:
    """The fluid model's highest rate with mean latencies within the SLO limits, and its TTFT at the target's
    percentile within the TTFT limit (its spread is mostly the prompts' own), 0 if none. With traffic classes,
    the strictest class's limit on each metric binds (:func:`~llmsim.search.window.binding_targets`).

    Scanned on a geometric grid from 1/20 to 20 times the scenario's rate, then on a fine
    grid across the step where the limits give out (a few ms, all rates at once). Each grid is
    evaluated from its top down, :data:`FLUID_CHUNK` rates at a time, until a chunk holds a passing
    rate: the highest passing rate is the same as the whole grid's, and the rates far below it are
    never solved (a chunk of loads near each other also sizes the solver's prompt counts to them,
    not to the grid's heaviest load).

    ``floor_per_s``: the answer matters only at or above it (a screen that keeps the best few). Once the
    rates scanned show the answer to lie below it, the scan stops and returns NaN: every rate from a chunk's
    lowest up failed, so the answer is at most that rate (the fine grid between the highest passing coarse rate
    and the next ends at the next), and that rate is below the floor. A scan the floor does not stop is the
    scan without it, chunk for chunk, so its answer is the same.
    """
    model = fluid_model(scenario, trace)
    limits = binding_targets(scenario)
    mean_limits_s = {metric: limit for metric, (limit, _) in limits.items()}

    ttft_percentile = limits["ttft"][1] if "ttft" in limits else None

    def passing(rates):
        frame = model.evaluate(rates, mean_limits_s, ttft_percentile)
        ok = frame["stable"].to_numpy().copy()
        for metric, limit in mean_limits_s.items():
            ok &= frame[f"{metric}_mean_s"].to_numpy() <= limit
        if ttft_percentile is not None:
            ok &= frame["ttft_percentile_s"].to_numpy() <= limits["ttft"][0]
        return ok

    def last_passing(rates: np.ndarray) -> int | None:
        """The highest passing rate's index, None where none passes, -1 where it is shown below the floor."""
        for stop in range(len(rates), 0, -FLUID_CHUNK):
            start = max(stop - FLUID_CHUNK, 0)
            ok = np.flatnonzero(passing(rates[start:stop]))
            if len(ok):
                return start + int(ok[-1])
            if rates[start] < floor_per_s:
                return -1
        return None

    own = scenario.workload.rate_per_s
    rates = own * np.geomspace(0.05, 20, 40)
    last = last_passing(rates)
    if last is None:
        return 0.0
    if last == -1 or (last < len(rates) - 1 and rates[last + 1] < floor_per_s):
        return math.nan
    if last == len(rates) - 1:
        return float(rates[-1])
    fine = np.linspace(rates[last], rates[last + 1], 17)
    fine_last = last_passing(fine)
    if fine_last == -1:
        # every fine rate from the chunk's lowest up failed: the answer is the highest below it, or rates[last]
        return math.nan
    return float(fine[fine_last]) if fine_last is not None else float(rates[last])


def recommend(scenario: str | Path | Scenario, *, objective: str | Objective = Objective.GOODPUT,
              seeds: int | Sequence[int] = SEEDS,
              top: int = TOP, workers: int | None = None, tolerance: float = 0.04, requests: int | None = None,
              progress: Progress = QUIET, drafts: bool = False, search: str | SearchScope = SearchScope.ALL,
              class_timeouts_s: Sequence[float] = CLASS_TIMEOUTS_S) -> Recommendation:
    """Search k, max batch tokens and queue timeout, and with traffic classes the scheduling policy and
    each class's queue timeout (see the module docstring).

    ``seeds``: independent traces per setting (>= 2, for confidence intervals), a count from
    the scenario's seed or the seeds themselves; ``top``:
    analytic best settings to simulate; ``tolerance``: relative width at which the
    bisection on the rate stops; ``requests``: simulate this many requests per run
    instead of the scenario's ``workload.num_requests``; ``drafts``: for a speculating scenario,
    also choose the draft and tune the eligibility thresholds at the scenario's rate
    in the same search (:class:`DraftSearch`); ``search="classes"``: only the scheduling policy and
    the class timeouts (step 4), the scenario's other settings kept and taken as the baseline;
    ``class_timeouts_s``: the queue timeouts step 4 tries for each class (besides its own).
    """
    started = time.perf_counter()
    scenario = as_scenario(scenario)
    check_rate_driven(scenario)
    objective, search = Objective.of(objective, "objective"), SearchScope.of(search, "search")
    class_timeouts_s = tuple(sorted({float(t) for t in class_timeouts_s}))
    if not class_timeouts_s or not all(0 < t <= MAX_CLASS_TIMEOUT_S for t in class_timeouts_s) \
            or len(class_timeouts_s) > MAX_CLASS_TIMEOUTS:
        raise ConfigError("bad queue timeouts to search", key="class_timeouts_s", value=list(class_timeouts_s),
                          allowed=f"1 to {MAX_CLASS_TIMEOUTS} durations in (0, {MAX_CLASS_TIMEOUT_S:g} s]")
    if search is SearchScope.CLASSES and not scenario.workload.classes:
        raise ConfigError("the scenario has no traffic classes to search", file=scenario.path, key="workload.classes",
                          has_value=False, allowed="workload.classes (two or more), or --search all")
    if not scenario.slo.defined:
        raise ConfigError("the scenario sets no SLO to recommend settings for", file=scenario.path, key="slo",
                          has_value=False, allowed="ttft, tpot and/or e2e limits")
    check_cycle_fits(scenario)
    seed_list = list(range(scenario.seed, scenario.seed + seeds)) if isinstance(seeds, int) else list(seeds)
    if len(seed_list) < 2:
        raise ConfigError("confidence intervals need at least 2 seeds", key="seeds", value=seeds,
                          allowed="a count >= 2, or 2 or more seeds")
    if top < 1:
        raise ConfigError("simulate at least the analytic best setting", key="top", value=top,
                          allowed="an integer >= 1")
    if requests is not None:
        scenario = with_requests(scenario, requests)
    if replays_one_trace(scenario):
        seed_list = seed_list[:1]          # every seed runs the same requests: one replication, no interval
    # ``progress`` counts every simulation of the search, its total growing as the bisections ask for more.
    # A run the search asks for twice (a screened candidate's first bisection step, at the probe rate) runs once.
    speculating = drafts and search is SearchScope.ALL and scenario.speculation is not None
    with reusing_runs():
        searcher = _Search(scenario, seed_list, objective, workers, tolerance, progress,
                           own_settings=search is SearchScope.CLASSES, class_timeouts_s=class_timeouts_s)
        analytic = pd.DataFrame(columns=["k", "max_batch_tokens", "analytic_rate_per_s", "screened_out"])
        experts = None
        # The search asks only whether points meet the targets: a run sure to miss them stops there
        # (llmsim.search.window); the figures shown at the scenario's rate come from whole runs.
        with stopping_decided_runs():
            if search is SearchScope.ALL:
                # 1. the coarse grid, scored by the fluid model
                grid = [Config(k, m, None) for k in k_options(scenario) for m in batch_token_options(scenario)]
                analytic = searcher.screen_grid(grid, top)
                chosen = [Config(r.k, int(r.max_batch_tokens), None) for r in analytic.head(top).itertuples()]
                screened = contenders = None
                if speculating:
                    # 1b. every proposer at Theorem 3.8's k, scored by the fluid model across loads
                    screened = _draft_screen(scenario, searcher, int(analytic["max_batch_tokens"].iloc[0]))
                    contenders = list(screened["config"].head(DRAFT_TOP))
                    rule = screened[screened["in_band"]]
                    contenders += list(rule["config"].head(1))
                    searcher.protected.update(rule["config"].head(1))     # the rule is judged on its full goodput
                # 2. simulate them, and the rule-of-thumb defaults: the analytic best, the defaults and the proposers
                # first (the 20-30% rule compares the proposers' goodputs), then the others as challengers of the
                # leader among those
                searcher.evaluate(chosen[:1] + searcher.defaults[:1] + (contenders or []))
                searcher.evaluate(chosen + searcher.defaults)
                # 3. refine around the best (k, batch tokens, timeouts, with a draft its eligibility rule)
                searcher.evaluate(_neighbours(searcher.best(), scenario))
                if speculating and searcher.best().k != OFF:
                    searcher.evaluate(_eligibility_options(searcher.best(), scenario))
                # 3b. a mixture-of-experts model: the best setting at every expert-parallel degree, chosen on cost
                experts = searcher.experts(searcher.best()) if searches_experts(scenario) else None
            else:
                searcher.evaluate(searcher.defaults)        # the scenario's own settings
            # 4. with traffic classes: the policy and every class's timeout, jointly
            classes = searcher.classes(searcher.best()) if scenario.workload.classes else None
        best = searcher.best()
        table = searcher.table()
        if not table["meets_scenario_rate"].iloc[0]:
            # Per seed: a seed that failed below the scenario's rate stopped there (its goodput in the table is
            # then 0, which a mean over seeds would hide).
            rate = scenario.workload.rate_per_s
            seeds_text = "; ".join(f"seed {seed} {_seed_text(bracket, rate)}"
                                   for seed, bracket in zip(searcher.seeds, searcher.brackets[best]))
            raise ConfigError(f"no searched setting meets the SLO targets at the scenario's rate ({rate:g}/s) on "
                              f"every seed; the best, {best.label}: {seeds_text}", file=scenario.path,
                              key="workload.arrival.rate", value=scenario.workload.rate_per_s,
                              allowed="a lower rate, more replicas (llmsim plan), or looser SLOs")
        default_rows = table[table["default"]]
        best_default = default_rows.iloc[0]
        best_row = table.iloc[0]
        with np.errstate(divide="ignore", invalid="ignore"):     # a default that never passes: an infinite gain
            if objective is Objective.GOODPUT:
                gains = np.array(best_row["per_seed_rates"]) / np.array(best_default["per_seed_rates"]) - 1.0
                improvement = np.float64(best_row["max_rate_per_s"]) / best_default["max_rate_per_s"] - 1.0
            else:
                improvement = 1.0 - np.float64(best_row["usd_per_million_output_tokens"]) / best_default[
                    "usd_per_million_output_tokens"]
                gains = np.array([improvement])
        finalists = list(classes.best_per_policy.values()) if classes is not None else []
        at_rate = searcher.at_scenario_rate([best, best_default["config"], *finalists])
        policies = _policy_table(classes, table, at_rate, scenario) if classes is not None else None
        advice = DraftSearch.of(screened, searcher.table(), scenario) if speculating else None
        # each seed's rate is known to the bisection's tolerance, so a gain to about (1 + gain) x tolerance
        resolution = (1 + improvement) * tolerance if objective is Objective.GOODPUT else 0.0
        return Recommendation(best, table, default_rows, at_rate, objective, float(improvement),
                              _ci(gains, resolution),
                              analytic, time.perf_counter() - started, advice, search, classes, policies, experts)


def _seed_text(bracket: _Bracket, rate_per_s: float) -> str:
    """What one seed's bisection showed about the scenario's rate: passed up to a rate, or failed below it."""
    if bracket.meets(rate_per_s):
        return f"passes up to {bracket.passing:.3g}/s"
    if bracket.raced_out:
        return "not simulated at it (another setting ranked higher)"
    passed = f" (passes {bracket.passing:.3g}/s)" if bracket.passing > 0 else ""
    return f"fails at {bracket.failing:.3g}/s{passed}"


def replays_one_trace(scenario: Scenario) -> bool:
    """Whether nothing of a run depends on the seed: a replayed trace without ``sample:`` (the only
    draw a trace's transforms make) and no speculation (whose acceptance draws are seeded)."""
    workload = scenario.workload
    if workload.trace is None or scenario.speculation is not None:
        return False
    return workload.transforms is None or workload.transforms.sample_fraction is None


def _neighbours(best: Config, scenario: Scenario) -> list[Config]:
    out = [replace(best, queue_timeout_s=t) for t in TIMEOUTS_S]
    for factor in (0.5, 2.0) if searches_batch_tokens(scenario) else ():
        m = int(best.max_batch_tokens * factor)
        if scenario.engine.max_num_seqs <= m <= max(2 ** 15, scenario.max_model_len):
            out.append(replace(best, max_batch_tokens=m))
    if best.k.policy is KPolicyName.STATIC:
        k = best.k.k
        assert scenario.speculation is not None            # a static k is searched only for a speculating scenario
        k_max = scenario.speculation.policy.k_max
        out += [replace(best, k=KChoice(KPolicyName.STATIC, j)) for j in (k - 1, k + 1) if 1 <= j <= k_max]
    engine = scenario.engine
    if engine.prefix_caching:
        size = best.block_size or engine.block_size
        out += [replace(best, block_size=b) for b in (size // 2, size * 2) if BLOCK_SIZES[0] <= b <= BLOCK_SIZES[1]]
    if engine.cpu_offload is not None:
        out += [replace(best, idle_timeout_s=t) for t in IDLE_TIMEOUTS_S]
    return out


def _acceptance_workload(scenario: Scenario) -> str:
    """The workload the scenario's predicted acceptance names, else chat: what candidates are predicted for."""
    acceptance = scenario.speculation.acceptance if scenario.speculation is not None else None
    return acceptance.workload if acceptance is not None else WORKLOADS[0]


def _draft_screen(scenario: Scenario, searcher: _Search, max_batch_tokens: int) -> pd.DataFrame:
    """Every proposer the target can verify (:func:`llmsim.search.draft_choice.candidates`, and drafts of
    20-30% of its parameters, :func:`~llmsim.search.draft_choice.in_band_candidates`) at Theorem 3.8's
    static k, scored by the fluid model's goodput across loads at ``max_batch_tokens``; best first. A draft
    that leaves no KV room for one longest request is left out."""
    workload = _acceptance_workload(scenario)
    options = [c for c in candidates(scenario, workload, own_draft=False) if c.kind is not None]
    options += in_band_candidates(scenario.model, workload)
    context = float(np.mean(searcher.trace.prompt_tokens) + np.mean(searcher.trace.output_tokens) / 2)
    rows = []
    for candidate in options:
        if with_candidate(scenario, candidate, 1).memory.kv_capacity_tokens < scenario.max_model_len:
            continue
        c = cost_ratio(scenario, candidate, context)
        k, speedup = theorem_3_8(candidate.alpha, c, candidate.proposer.sequential, candidate.k_max)
        config = Config(KChoice(KPolicyName.STATIC, k), max_batch_tokens, None, draft=candidate)
        rows.append({"candidate": candidate.label, "kind": candidate.kind,
                     "params_ratio": (candidate.draft.param_count / scenario.model.param_count
                                      if candidate.kind is MODEL and candidate.draft is not None else math.nan),
                     "alpha": candidate.alpha, "c": c, "k": k, "speedup_theorem_3_8": speedup,
                     "analytic_rate_per_s": searcher.analytic(config), "in_band": in_band(candidate, scenario.model),
                     "config": config})
    return pd.DataFrame(rows).sort_values("analytic_rate_per_s", ascending=False, kind="stable").reset_index(drop=True)


def _eligibility_options(best: Config, scenario: Scenario) -> list[Config]:
    """The best setting under each eligibility rule: min_concurrent_requests 1 or the scenario's,
    min_sequence_tokens 0 or the scenario's; less the rule it has (the same setting, simulated already)."""
    assert scenario.speculation is not None                # eligibility is searched only for a speculating scenario
    own, held = scenario.speculation.eligibility, eligibility_of(best, scenario)
    return [replace(best, eligibility=(tokens, concurrent)) for tokens in sorted({0, own.min_sequence_tokens})
            for concurrent in sorted({1, own.min_concurrent_requests}) if (tokens, concurrent) != held]


def eligibility_of(config: Config, scenario: Scenario) -> tuple[int, int] | None:
    """The eligibility rule a speculating setting runs with, (min_sequence_tokens, min_concurrent_requests):
    its own, else the scenario's (or its draft candidate's); None where it does not speculate."""
    if config.eligibility is not None:
        return config.eligibility
    speculation = variant(scenario, config.overrides(scenario)).speculation
    if speculation is None:
        return None
    return speculation.eligibility.min_sequence_tokens, speculation.eligibility.min_concurrent_requests


@dataclass
class DraftSearch:
    """The proposer, k policy and eligibility rule of the recommendation, from the one search: every
    proposer screened (Theorem 3.8's k at batch 1, then the fluid model's goodput across loads), the
    best few and the best draft of 20-30% of the target's parameters simulated (goodput bisected like
    every setting), the best setting's eligibility rules simulated too."""
    best: Config
    screened: pd.DataFrame          # every proposer: alpha, c, k, Theorem 3.8's speedup, fluid and simulated goodput
    eligibility: pd.DataFrame       # each eligibility rule on the best setting, its simulated goodput
    rule_holds: bool | None         # the 20-30% rule: None where no in-band draft was simulated
    rule_text: str

    @classmethod
    def of(cls, screened: pd.DataFrame, table: pd.DataFrame, scenario: Scenario) -> DraftSearch:
        by_config = table.set_index(table["config"].map(lambda c: c.label))

        def goodput(config: Config) -> tuple[float, float, bool]:
            if config.label not in by_config.index:
                return math.nan, math.nan, False
            row = by_config.loc[config.label]
            return row["max_rate_per_s"], row["max_rate_per_s.ci95"], bool(row["raced_out"])
        screened = screened.copy()
        simulated = [goodput(c) for c in screened["config"]]
        screened["max_rate_per_s"] = [g for g, _, _ in simulated]
        screened["max_rate_per_s.ci95"] = [ci for _, ci, _ in simulated]
        screened["raced_out"] = [r for _, _, r in simulated]
        best = table["config"].iloc[0]
        # the best setting under each eligibility rule simulated, the best itself included (under its own rule)
        same = table[table["config"].map(lambda c: replace(c, eligibility=None) == replace(best, eligibility=None))]
        held = [eligibility_of(c, scenario) for c in same["config"]]
        rows = same[[rule is not None for rule in held]]
        rules = [rule for rule in held if rule is not None]
        eligibility = pd.DataFrame({"min_sequence_tokens": [rule[0] for rule in rules],
                                    "min_concurrent_requests": [rule[1] for rule in rules],
                                    "max_rate_per_s": rows["max_rate_per_s"].to_numpy(),
                                    "max_rate_per_s.ci95": rows["max_rate_per_s.ci95"].to_numpy(),
                                    "raced_out": rows["raced_out"].to_numpy(dtype=bool),
                                    "failing_rate_per_s": rows["failing_rate_per_s"].to_numpy()})
        holds, text = _rule_verdict(screened, best, scenario)
        return cls(best, screened, eligibility, holds, text)

    def text(self) -> str:
        best = self.best
        proposer = ("none (plain decoding)" if best.k == OFF else best.draft.label if best.draft is not None
                    else "the scenario's own")
        lines = [f"speculation, one answer from the search across loads: proposer {proposer}, k {best.k}"
                 + ("" if best.k == OFF else ", eligibility as in the scenario" if best.eligibility is None else
                    f", eligibility min_sequence_tokens {best.eligibility[0]}, "
                    f"min_concurrent_requests {best.eligibility[1]}"),
                 "  proposers screened (Theorem 3.8's k at batch 1, the fluid model's goodput across loads at that k; "
                 "simulated goodput for those simulated):"]
        for _, row in self.screened.iterrows():
            share = "" if math.isnan(row["params_ratio"]) else f" ({100 * row['params_ratio']:.0f}% of the target)"
            goodput, ci = row["max_rate_per_s"], row["max_rate_per_s.ci95"]
            simulated = "" if math.isnan(goodput) else (
                f", simulated at least {goodput:.3g} req/s" if row["raced_out"] else
                f", simulated {goodput:.3g}" + ("" if math.isnan(ci) else f" +- {ci:.2g}") + " req/s")
            lines.append(f"  {row['candidate'] + share:<44} alpha {row['alpha']:.2f}, c {row['c']:.3f}, k {row['k']}, "
                         f"{row['speedup_theorem_3_8']:.2f}x; fluid {row['analytic_rate_per_s']:.3g} req/s{simulated}")
        lines.append(f"  {self.rule_text}")
        if len(self.eligibility):
            lines.append("  eligibility rules on the recommendation (simulated goodput): " + "; ".join(
                f"{r.min_sequence_tokens} tokens / {r.min_concurrent_requests} requests "
                f"{_bounded(r.max_rate_per_s, r.raced_out, r.failing_rate_per_s)} req/s"
                for r in self.eligibility.itertuples()))
        return "\n".join(lines)


def _bounded(goodput: float, raced_out: bool, failing: float) -> str:
    """A simulated goodput; one raced out is known only as at least its passing rates or, where it never
    passed, below its failing ones."""
    if not raced_out:
        return f"{goodput:.3g}"
    return f"at least {goodput:.3g}" if goodput > 0 else f"below {failing:.3g}"


def _rule_verdict(screened: pd.DataFrame, best: Config, scenario: Scenario) -> tuple[bool | None, str]:
    """The 20-30% rule judged on simulated goodput: the best simulated in-band draft against the best
    simulated proposer at the same settings (and the recommendation itself)."""
    ran = screened[screened["max_rate_per_s"].notna()]
    band = ran[ran["in_band"]]
    if best.draft is not None and in_band(best.draft, scenario.model):
        return True, f"the 20-30% rule holds: the recommended draft is {best.draft.label}"
    if band.empty:
        return None, "the 20-30% rule is not judged: no draft of 20-30% of the target's parameters fits"
    rule = band.loc[band["max_rate_per_s"].idxmax()]
    peer = ran.loc[ran["max_rate_per_s"].idxmax()]
    cost = rule["max_rate_per_s"] / peer["max_rate_per_s"] - 1

    def goodput(row) -> str:
        """A raced-out goodput is a lower bound, with no interval."""
        if row["raced_out"]:
            return f"at least {row['max_rate_per_s']:.3g}"
        ci = row["max_rate_per_s.ci95"]
        return f"{row['max_rate_per_s']:.3g}" + ("" if math.isnan(ci) else f" +- {ci:.2g}")
    return False, (f"the 20-30% rule does not hold: its best draft, {rule['candidate']} "
                   f"({100 * rule['params_ratio']:.0f}% of the target's parameters), sustains {goodput(rule)} req/s "
                   f"against {goodput(peer)} for {peer['candidate']} at the same settings ({100 * cost:+.0f}%)")


def class_timeout_options(timeouts_s: Sequence[float], start: float | None) -> list[float]:
    """The queue timeouts tried for one class: those searched and the one it starts with."""
    return sorted({*timeouts_s, *([start] if start is not None else [])})


def _with_timeout(config: Config, name: str, timeout_s: float) -> Config:
    assert config.class_timeouts is not None               # a classes-search setting names every class's timeout
    return replace(config, class_timeouts=tuple((n, timeout_s if n == name else t) for n, t in config.class_timeouts))


def _screen_key(judged: Judged) -> tuple[bool, bool, float]:
    """How a screened candidate ranks: meeting every class's targets, then, among those that miss them,
    a run that went to its end before one stopped sure to miss (its whole run misses a watched target by
    more than the stop's margin, :mod:`llmsim.sim.missed`; the figures it stopped with cover only part of
    it), then its worst margin (a NaN, a class with no requests measured, last)."""
    verdict = judged.verdict
    margin = verdict.worst_margin[0]
    return verdict.met, not judged.stopped, margin if math.isfinite(margin) else -math.inf


_NO_BAR = (False, False, -math.inf)      # the lowest screen key: a configuration without a bar always runs


def _seeds_by_shortfall(judged: Judged) -> list[int]:
    """A screened setting's seeds, those on which its worst limit's attainment was lowest first (of equals, in
    the search's order). A setting's neighbours run on the same requests (common random numbers), so their
    screens tend to fall short on the same seeds: run first, those rule out most (:func:`best_case` takes every
    seed not run yet at its best)."""
    worst = _worst_check(judged.verdict)
    column = limit_checks(judged.rows)[worst][0] if worst else None
    attainments = judged.rows[column].to_numpy(dtype=float) if column else np.zeros(len(judged.rows))
    order = sorted(range(len(judged.rows)), key=lambda i: (np.nan_to_num(attainments[i], nan=np.inf), i))
    return [int(judged.rows["seed"].iat[i]) for i in order]


def _worst_check(verdict: Verdict) -> str:
    return min(verdict.margins, key=lambda name: verdict.margins[name][0]) if verdict.margins else ""


def class_timeouts(config: Config, scenario: Scenario) -> tuple[tuple[str, float | None], ...]:
    """Each class's queue timeout under ``config``: its own setting, else the class's, else the engine's."""
    engine_timeout = config.queue_timeout_s if config.queue_timeout_s is not None else scenario.engine.queue_timeout_s
    own = dict(config.class_timeouts or ())
    return tuple((c.name, own.get(c.name, c.queue_timeout_s if c.queue_timeout_s is not None else engine_timeout))
                 for c in scenario.workload.classes)


def config_key(config: Config) -> tuple:
    """What of a setting the fluid model sees: queue timeouts act on the tail, which it does not model, and
    every sequence speculates in it (the eligibility rules are left out, :mod:`llmsim.analysis.fluid`), so
    the settings that differ only in those share one fluid rate."""
    return config.k, config.max_batch_tokens, config.draft, config.expert_parallel


@dataclass(frozen=True)
class BarStop(MissedStop):
    """The stop of a class screen's run for a configuration that must beat a bar (:meth:`_Search._bar_stop`):
    ``base``'s (the rule the search's runs stop by, if any), and on each limit of ``spare`` (its name, as
    :func:`~llmsim.sim.missed.limit_name` gives it, and a share) once the window's requests sure to miss it
    are more than that share of the ``counted`` it is measured on: the configuration's screen is then below its
    bar whatever the rest of the run shows. A run it stops on its bar is below no share of its own."""
    spare: tuple[tuple[str, float], ...]
    base: MissedStop | None = None

    def allowed(self, share: float, counted: int) -> int:
        return counted if self.base is None else self.base.allowed(share, counted)

    def allowed_on(self, name: str, share: float, counted: int) -> int:
        allowed = self.allowed(share, counted)
        spare = dict(self.spare).get(name)
        # the 1e-6: a product that is whole may round below it; allowing more only stops later
        return allowed if spare is None else min(allowed, math.floor(spare * counted + 1e-6))

    def highest(self, share: float) -> float:
        return 1.0


class _Search:
    """Simulated highest passing rate per (configuration, seed), bisected for all at once."""

    def __init__(self, scenario: Scenario, seeds: list[int], objective: Objective, workers, tolerance: float,
                 progress: Progress, own_settings: bool = False,
                 class_timeouts_s: Sequence[float] = CLASS_TIMEOUTS_S, racing: bool = True):
        self.scenario, self.seeds, self.objective = scenario, seeds, objective
        self.racing = racing and objective is Objective.GOODPUT     # cost ranks by dollars: every goodput is needed
        self.protected: set[Config] = set()                 # bisected to the end, like the defaults
        self.workers, self.tolerance, self.progress = workers, tolerance, progress
        self.class_timeouts_s = tuple(class_timeouts_s)
        self.results: dict[Config, dict] = {}
        self.brackets: dict[Config, list[_Bracket]] = {}            # per seed, as each bisection ended
        self.screened: dict[tuple[Config, float], Judged] = {}      # (candidate, probe rate) -> its screen
        # (candidate, probe rate) -> the highest screen key it can reach, and its screen on the seeds it ran
        self.ruled_out: dict[tuple[Config, float], tuple[tuple[bool, bool, float], Judged]] = {}
        self._analytic: dict[tuple, float] = {}
        self._windows: dict[str, Window] = {}       # a probe point (json) -> its window (judge)
        self._fluid: dict[str, FluidModel | DisaggregatedFluid | None] = {}     # a setting (json) -> its fluid model
        self.rate = scenario.workload.rate_per_s
        self.expert_degree: int | None = None                # chosen by step 3b: its settings rank first
        engine = scenario.engine
        # The baseline: the rule-of-thumb defaults, or (own_settings) the scenario's own settings.
        self.defaults = ([Config(OFF if scenario.speculation is None else SCENARIO_K, engine.max_batch_tokens,
                                 engine.queue_timeout_s)] if own_settings else
                         [Config(rule_k(scenario), rule_of_thumb_max_batch_tokens(scenario)
                                 if searches_batch_tokens(scenario) else engine.max_batch_tokens, t)
                          for t in TIMEOUTS_S])
        self.trace = generate_trace(scenario.workload, scenario.seed)     # the knobs leave it unchanged

    def analytic(self, config: Config, floor_per_s: float = -math.inf) -> float:
        """The fluid model's rate of ``config`` (:func:`analytic_rate`; NaN: not a valid setting here). With
        ``floor_per_s``: NaN, and nothing remembered, where its scan shows the rate to lie below the floor."""
        key = config_key(config)
        if key not in self._analytic:
            try:
                rate = analytic_rate(variant(self.scenario, config.overrides(self.scenario)), self.trace,
                                     floor_per_s)
            except ConfigError:           # not a valid setting here (e.g. too little memory left)
                rate = math.nan
            else:
                if math.isnan(rate):      # below the floor: not known, and asked again without one if needed
                    return rate
            self._analytic[key] = rate
        return self._analytic[key]

    def screen_grid(self, grid: Sequence[Config], top: int) -> pd.DataFrame:
        """The coarse grid scored by the fluid model, best first: k, max batch tokens, the fluid rate and
        ``screened_out``, where the scan stopped once the rate was shown below the ``top``-th best of the settings
        scored before it (its rate NaN; it ranks below every setting scored, so the best ``top`` are the whole
        grid's, each with its rate)."""
        rows: list[dict] = []
        scored: list[float] = []
        for config in grid:
            floor = sorted(scored, reverse=True)[top - 1] if len(scored) >= top else -math.inf
            rate = self.analytic(config, floor)
            screened_out = math.isnan(rate) and config_key(config) not in self._analytic
            if not math.isnan(rate):
                scored.append(rate)
            rows.append({"k": config.k, "max_batch_tokens": config.max_batch_tokens, "analytic_rate_per_s": rate,
                         "screened_out": screened_out})
        frame = pd.DataFrame(rows, columns=["k", "max_batch_tokens", "analytic_rate_per_s", "screened_out"])
        return frame.sort_values("analytic_rate_per_s", ascending=False, kind="stable").reset_index(drop=True)

    def evaluate(self, configs: Sequence[Config], start_rate_per_s: float | None = None) -> None:
        """Simulate each new configuration's highest passing rate, per seed, all at once.

        Per (configuration, seed) a bracket [passing rate, failing rate] starts at
        ``start_rate_per_s`` if given, else at the analytic rate scaled by how the simulated
        rates so far compare with the analytic ones (with none yet: the pilot's, the first configuration's
        first seed bisected alone), steps until it brackets (by ``tolerance`` from an informed start, else by
        20%), then bisects to ``tolerance``. Whether the scenario's own rate passes follows from the
        bracket, or is simulated when it lies inside it. A configuration's other seeds start once its
        first seed's bisection has ended, each first at that seed's failing rate, then at its passing rate.

        Once a setting has been bisected to the end and leads (:meth:`leader`), a new setting that is not
        protected is a *challenger* (a default, of the best default): each seed is simulated first at the leader's
        failing rate for that seed, then (where it failed there) at its passing rate (common random numbers: the
        same requests as the leader's runs, which are reused where the two settings run alike), and it is
        stopped as soon as it cannot beat the leader by more than the leader's own bracket (:meth:`race`): one
        failing run per seed, the cheapest verdict (an undecided fail is not measured longer), stops a
        setting that is no better. That run, at the leader's failing rate, is one window whatever its verdict:
        an undecided pass there is taken as a fail (the challenger's capacity is then within the window's
        resolution of a rate the leader failed, a tie the leader keeps), so a challenger goes on only where
        the window shows it to pass.
        """
        todo = []
        for config in configs:
            if config in self.results or config in todo:
                continue
            try:
                variant(self.scenario, config.overrides(self.scenario))
            except ConfigError:
                continue
            todo.append(config)
        if not todo:
            return
        scale = self.simulated_over_analytic()
        guess = {c: self.analytic(c) for c in todo}
        start = {c: start_rate_per_s if start_rate_per_s is not None else
                 guess[c] * scale if guess[c] > 0 else self.rate for c in todo}
        brackets = {(c, s): _Bracket() for c in todo for s in self.seeds}
        # A default challenges the best default (the baseline the gain is measured against), any other the leader.
        leaders = {} if start_rate_per_s is not None else {True: self.leader(defaults=True), False: self.leader()}
        challengers: dict[Config, Config] = {}
        for c in todo:
            leader = leaders.get(c in self.defaults)
            if leader is not None and c not in self.protected:
                challengers[c] = leader
        at_leaders_failing: dict[tuple[Config, int], float] = {}
        for c, leader in challengers.items():
            for s, held in zip(self.seeds, self.brackets[leader]):
                brackets[(c, s)].probes = [held.failing, held.passing]
                brackets[(c, s)].step = 1 + self.tolerance
                at_leaders_failing[(c, s)] = held.failing
        if self.ratios():
            for c in todo:
                brackets[(c, self.seeds[0])].step = 1 + self.tolerance
        # Any other setting is bisected on its first seed alone; its other seeds then start from that bracket.
        first_seed = {c: brackets[(c, self.seeds[0])] for c in todo if c not in challengers}
        # With no simulated rate to scale the fluid model's by yet, the first of them is a pilot: bisected alone
        # on its first seed, its ratio then scales the others' starts.
        pilot = next(iter(first_seed), None) if start_rate_per_s is None and not self.ratios() else None
        for _ in range(60):
            if self.racing:
                self.race(todo, brackets, challengers)
            for c, first in list(first_seed.items()):
                if first.next_rate(start[c], self.rate, self.tolerance) is None:
                    for s in self.seeds[1:]:
                        brackets[(c, s)].probes = [first.failing, first.passing]
                        brackets[(c, s)].step = 1 + self.tolerance
                    del first_seed[c]
            if pilot is not None and pilot not in first_seed:
                ratio = brackets[(pilot, self.seeds[0])].passing / guess[pilot] if guess[pilot] > 0 else 0.0
                if ratio > 0:
                    start |= {c: guess[c] * ratio if guess[c] > 0 else self.rate for c in first_seed}
                    for c in first_seed:
                        brackets[(c, self.seeds[0])].step = 1 + self.tolerance
                pilot = None
            jobs = [(key, rate) for key, bracket in brackets.items()
                    if not (key[0] in first_seed and (key[1] != self.seeds[0] or pilot not in (None, key[0])))
                    and (rate := bracket.next_rate(start[key[0]], self.rate, self.tolerance)) is not None]
            if not jobs:
                break
            # A challenger's probe at the leader's failing rate is measured over one window: only a decided pass
            # there keeps it going (the docstring says why); every other probe as judge() measures it.
            once = [job for job in jobs if at_leaders_failing.get(job[0]) == job[1]]
            for group, escalate in (([job for job in jobs if job not in once], True), (once, False)):
                if not group:
                    continue
                points = [{**c.overrides(self.scenario), RATE_KEY: rate, "seed": s} for (c, s), rate in group]
                for ((c, s), rate), judged in zip(group, self.judge(points, escalate=escalate)):
                    met = judged.verdict.met and (escalate or judged.verdict.decided)
                    brackets[(c, s)].record(rate, met, judged.rows.iloc[0])
        for c in todo:
            runs = [brackets[(c, s)] for s in self.seeds]
            self.brackets[c] = runs
            rates = np.array([b.passing for b in runs])
            cost = np.array([b.usd_per_million for b in runs])
            self.results[c] = {"config": c, "k": c.k, "max_batch_tokens": c.max_batch_tokens,
                               "queue_timeout_s": c.queue_timeout_s,
                               "block_size": c.block_size or self.scenario.engine.block_size,
                               "idle_timeout_s": c.idle_timeout_s if c.idle_timeout_s is not None else (
                                   self.scenario.engine.cpu_offload.idle_timeout_s
                                   if self.scenario.engine.cpu_offload is not None else math.nan),
                               "scheduling_policy": c.policy or self.scenario.engine.scheduling_policy,
                               "class_timeouts": dict(class_timeouts(c, self.scenario)) or None,
                               "expert_parallel": self.degree_of(c),
                               "analytic_rate_per_s": guess[c],
                               "max_rate_per_s": rates.mean(),
                               "max_rate_per_s.ci95": _ci(rates, self.tolerance * rates.mean()),
                               "usd_per_million_output_tokens": float(np.nanmean(cost)) if np.isfinite(cost).any()
                               else math.nan,
                               "meets_scenario_rate": all(b.meets(self.rate) for b in runs),
                               "per_seed_rates": tuple(rates), "raced_out": runs[0].raced_out,
                               # an upper bound on the goodput: where a raced-out setting never passed, all it says
                               "failing_rate_per_s": float(np.mean([b.failing for b in runs]))}

    def leader(self, defaults: bool = False) -> Config | None:
        """The setting that ranks first so far (``defaults``: among the defaults), where its goodput was
        bisected to the end (not raced out) and it meets the scenario's rate; None otherwise (no challenger is
        then anchored to it)."""
        if not self.racing or not self.results:
            return None
        table = self.table()
        if defaults:
            table = table[table["default"]]
        if table.empty:
            return None
        row = table.iloc[0]
        return None if row["raced_out"] or not row["meets_scenario_rate"] else row["config"]

    def race(self, todo: Sequence[Config], brackets: dict, challengers: Mapping[Config, Config] | None = None) -> None:
        """Stop bisecting the configurations that can no longer be the best: where the mean over seeds of
        the lowest rates seen to fail is below the mean of the highest seen to pass of another that meets
        the scenario's rate (every seed's final goodput lies below its failing rate, so that one's mean
        stays below the other's, and the ranking's first row is the same). The baseline defaults race
        only among themselves, for the best of them is what the gain is measured against; the protected
        settings are bisected to the end.

        A challenger of a finished leader (``challengers``: challenger -> its leader, :meth:`evaluate`) is
        also stopped once the mean of its
        failing rates is at or below the mean of the leader's: its goodput then lies below the leader's
        failing rates, within the bracket the leader's own bisection stopped in (the search's resolution,
        ``tolerance``), so it cannot be shown better than the leader; the leader keeps its rank."""
        def mean(values) -> float:
            return float(np.mean(list(values)))

        def incumbent(among) -> float:
            lows = [r["max_rate_per_s"] for c, r in self.results.items() if r["meets_scenario_rate"] and among(c)]
            lows += [mean(brackets[(c, s)].passing for s in self.seeds) for c in todo
                     if among(c) and all(brackets[(c, s)].meets(self.rate) for s in self.seeds)]
            return max(lows, default=-math.inf)     # none yet: nothing is stopped

        best, best_default = incumbent(lambda c: True), incumbent(lambda c: c in self.defaults)
        for c in todo:
            runs = [brackets[(c, s)] for s in self.seeds]
            if c in self.protected or runs[0].raced_out:
                continue
            bar = best_default if c in self.defaults else best
            if challengers and c in challengers:
                bar = max(bar, mean(b.failing for b in self.brackets[challengers[c]]))
            if mean(b.failing for b in runs) <= bar:
                for b in runs:
                    b.raced_out = True

    def ratios(self) -> list[float]:
        """Each finished setting's simulated highest passing rate over the fluid model's (where both are known)."""
        return [r["max_rate_per_s"] / r["analytic_rate_per_s"] for r in self.results.values()
                if r["analytic_rate_per_s"] > 0 and r["max_rate_per_s"] > 0 and not r["raced_out"]]

    def simulated_over_analytic(self) -> float:
        """How the simulated highest passing rates so far compare with the fluid model's (median ratio;
        0.85 before any)."""
        ratios = self.ratios()
        return float(np.median(ratios)) if ratios else 0.85

    def classes(self, base: Config) -> ClassSearch:
        """Step 4 of the search (module docstring): per scheduling policy, coordinate descent over the
        classes' queue timeouts, every candidate screened at one probe rate on the same requests; then
        each policy's best gets its goodput bisected."""
        scenario = self.scenario
        start = class_timeouts(base, scenario)
        # The probe rate: where the base only just passes; a base that fails at the scenario's rate has no such
        # rate, so the fluid model's estimate (scaled as the simulations so far compare with it) stands in.
        goodput = float(self.results[base]["max_rate_per_s"])
        if goodput <= 0:
            goodput = self.simulated_over_analytic() * float(self.results[base]["analytic_rate_per_s"])
        rate = max(self.rate, goodput) if math.isfinite(goodput) else self.rate     # NaN: no fluid estimate
        at_rate = variant(scenario, {**base.overrides(scenario), RATE_KEY: rate})
        # the window of a bisection's probe (:meth:`judge`): each policy's best then starts its bisection on
        # the runs it was screened with
        window = measurement_window(at_rate, rate, typical_latency_s(at_rate, rate), own_floor=False)
        current = {p: replace(base, policy=p, class_timeouts=start) for p in SchedulingPolicy}
        self.progress.note("classes: every policy")
        self.screen(list(current.values()), rate, window)
        sweeps = 0
        for sweeps in range(1, CLASS_SWEEPS + 1):
            moved = False
            for name, own in start:
                self.progress.note(f"classes: sweep {sweeps}, {name}'s timeout")
                options = class_timeout_options(self.class_timeouts_s, own)
                candidates = {p: [c] + [_with_timeout(c, name, t) for t in options] for p, c in current.items()}
                # each must beat its policy's current setting (screened already) to be chosen
                bars = {o: _screen_key(self.screened[(c, rate)]) for p, c in current.items() for o in candidates[p]}
                orders = {o: _seeds_by_shortfall(self.screened[(c, rate)]) for p, c in current.items()
                          for o in candidates[p]}
                self.screen([c for options in candidates.values() for c in options], rate, window, bars, orders)
                for p, tried in candidates.items():
                    # max keeps the first of equals: the current setting, unless another is strictly better
                    chosen = max((c for c in tried if (c, rate) in self.screened),
                                 key=lambda c: _screen_key(self.screened[(c, rate)]))
                    moved |= chosen != current[p]
                    current[p] = chosen
            if not moved:
                break
        self.progress.note("classes: goodput of each policy's best")
        self.evaluate(list(current.values()), start_rate_per_s=rate)
        visited = [*((key, j, False) for key, j in self.screened.items()),
                   *((key, j, True) for key, (_, j) in self.ruled_out.items())]
        screened = pd.DataFrame([{"scheduling_policy": c.policy, "class_timeouts": dict(c.class_timeouts or ()),
                                  "met": j.verdict.met, "worst_margin": j.verdict.worst_margin[0],
                                  "worst_check": _worst_check(j.verdict),
                                  "margins": {name: margin for name, (margin, _) in j.verdict.margins.items()},
                                  "steady": j.verdict.steady, "stopped": j.stopped, "seeds": len(j.rows),
                                  "ruled_out": out}
                                 for (c, r), j, out in visited if r == rate])
        return ClassSearch(rate, self.class_timeouts_s, sweeps, screened, current)

    def degree_of(self, config: Config) -> int:
        return own_degree(self.scenario) if config.expert_parallel is None else config.expert_parallel

    def experts(self, base: Config) -> ExpertSearch:
        """Step 3b: ``base`` at every expert-parallel degree of the scenario's tensor parallelism (1, and tp x 2^i
        splitting the experts, :func:`llmsim.search.layout.expert_degrees`), each bisected to the end (its cost at
        its goodput is what ranks it); the cheapest per million output tokens among those meeting the SLO at the
        scenario's rate is chosen (the scenario's own when none does), and the settings at it rank first."""
        scenario, own = self.scenario, own_degree(self.scenario)
        degrees = sorted({1, own, *expert_degrees(scenario, scenario.deployment.tensor_parallel, MAX_EXPERT_PARALLEL)})
        configs = {d: base if self.degree_of(base) == d else replace(base, expert_parallel=d) for d in degrees}
        refused, built = {}, {}
        for degree, config in configs.items():
            try:
                built[degree] = variant(scenario, config.overrides(scenario))
            except ConfigError as error:        # does not fit, or a group wider than a node without its network
                refused[degree] = error.message
        valid = [c for d, c in configs.items() if d not in refused]
        self.protected.update(valid)
        self.progress.note("expert-parallel degrees")
        self.evaluate(valid)
        rows = []
        for degree, config in configs.items():
            row = {"expert_parallel": degree, "refused": refused.get(degree, "")}
            if degree not in refused:
                result, one = self.results[config], built[degree]
                row |= {"data_parallel": one.deployment.data_parallel,
                        "devices_per_replica": one.devices_per_replica,
                        **{key: result[key] for key in ("max_rate_per_s", "max_rate_per_s.ci95",
                                                        "usd_per_million_output_tokens", "meets_scenario_rate")}}
            rows.append(row)
        table = pd.DataFrame(rows).rename(columns={"max_rate_per_s.ci95": "max_rate_per_s_ci95"})
        table["meets_scenario_rate"] = table["meets_scenario_rate"].astype("boolean").fillna(False).astype(bool)
        chosen = choose_degree(table, own)
        self.expert_degree = chosen
        return ExpertSearch(table, chosen, own)

    def screen(self, configs: Sequence[Config], rate: float, window: Window,
               bars: Mapping[Config, tuple[bool, bool, float]] | None = None,
               seed_orders: Mapping[Config, Sequence[int]] | None = None) -> None:
        """Each configuration not screened yet at ``rate``: one window per seed (no escalation), its
        verdict pooled over the seeds.

        ``bars``: configuration -> the screen key (:func:`_screen_key`) it must beat to be chosen. The seeds
        then run one at a time, and a configuration stops once even the best runs its other seeds could give
        leave it below its bar (:meth:`_best_key`): its screen on every seed could not be chosen. Its runs after
        the first seed's stop inside once their sure misses alone leave it there (:meth:`_bar_stop`). It is kept
        (:attr:`_Search.ruled_out`) with the key it can at most reach and the runs it had, and is screened again
        only where a later bar lies at or below that key (a policy's bar only rises as its search goes on).
        ``seed_orders``: the order a configuration's seeds run in (default: the search's), the seeds most likely to
        rule it out first (:func:`_seeds_by_shortfall`); its screen is judged on them in the search's order."""
        bars, seed_orders = bars or {}, seed_orders or {}
        todo = [c for c in dict.fromkeys(configs) if (c, rate) not in self.screened
                and not ((c, rate) in self.ruled_out and self.ruled_out[(c, rate)][0] < bars.get(c, _NO_BAR))]
        if not todo:
            return
        # configurations with a bar run seed by seed, the others every seed at once
        orders = {c: list(seed_orders.get(c, self.seeds)) for c in todo}
        waves = [slice(None)] if not any(c in bars for c in todo) else [slice(k, k + 1) for k in range(len(self.seeds))]
        rows: dict[Config, list[pd.DataFrame]] = {c: [] for c in todo}
        reach: dict[Config, tuple[bool, bool, float]] = {}     # with a bar: the best key on the seeds it ran
        # stopped below its bar (:meth:`_bar_stop`): the key it can at most reach, and the stop it ran under
        stopped: dict[Config, tuple[tuple[bool, bool, float], BarStop]] = {}
        for wave in waves:
            live = [c for c in todo if c not in stopped and (c not in reach or reach[c] >= bars[c])]
            stops = {c: self._bar_stop(rows[c], bars[c]) if c in bars and rows[c] else None for c in live}
            groups: dict[BarStop | None, list[Config]] = {}          # the same stop: runs that may be shared
            for c in live:
                groups.setdefault(held[1] if (held := stops[c]) is not None else None, []).append(c)
            # A preemptive priority run that goes to its end without preempting is the priority run and serves
            # every keyed policy's run of the same requests under any stop (reusing_runs), never the other way
            # round: the groups holding one run first.
            for rule, group in sorted(groups.items(), key=lambda item: not any(
                    c.policy is SchedulingPolicy.PREEMPTIVE_PRIORITY for c in item[1])):
                points = [{**c.overrides(self.scenario), RATE_KEY: rate, "seed": s} for c in group
                          for s in orders[c][wave]]
                with stopping_missed_runs(rule) if rule is not None else nullcontext():
                    judged = simulate_until_decided(self.scenario, points, [window] * len(points),
                                                    [rate] * len(points), workers=self.workers,
                                                    progress=self.progress, escalations=0)
                at = 0
                for c in group:
                    ran, at = judged[at:at + len(orders[c][wave])], at + len(orders[c][wave])
                    rows[c] += [one.rows for one in ran]
                    if (held := stops[c]) is not None and any(one.stopped for one in ran):
                        stopped[c] = held
                    elif c in bars and len(rows[c]) < len(self.seeds):
                        reach[c] = self._best_key(rows[c], window)
        for c in todo:
            # in the search's order of seeds: a pooled figure is summed in one order whatever order they ran in
            ran = pd.concat([one for _, one in sorted(zip(orders[c], rows[c]), key=lambda pair:
                                                      self.seeds.index(pair[0]))], ignore_index=True)
            if c in stopped:
                highest, rule = stopped[c]
                self.ruled_out[(c, rate)] = (highest, Judged(judge(ran, stop=rule), ran, window))
            elif len(ran) == len(self.seeds):
                self.screened[(c, rate)] = Judged(judge(ran), ran, window)
                self.ruled_out.pop((c, rate), None)
            else:
                self.ruled_out[(c, rate)] = (reach[c], Judged(judge(ran), ran, window))

    def _bar_stop(self, rows: list[pd.DataFrame], bar: tuple[bool, bool, float]
                  ) -> tuple[tuple[bool, bool, float], BarStop] | None:
        """The stop for a configuration's next seed's run, from its first seeds' runs (``rows``, each whole) and
        the screen key it must beat (``bar``), with the key it can at most reach where the stop stops the run;
        None where no sure misses could keep it below its bar (a bar that stopped itself, or none).

        Its screen key beats the bar only with a worst margin above the bar's (where the bar meets the targets,
        or where it cannot meet them: a first seed's run unsteady), else only with a margin of at least 0 (it
        meets them) or above the bar's. So it cannot beat the bar once some limit's margin is sure to stay below
        ``floor``, the bar's margin or the lower of it and 0. A limit's margin is the mean over the seeds of
        its attainment, less its target ``w``: with this run's at most ``1 - misses / counted`` (its window's
        requests sure to miss the limit, among the ``counted`` of its window it is measured on, as
        :class:`~llmsim.sim.missed.MissedStop` counts them) and every later seed's at most 1, it stays below
        ``floor`` once ``misses / counted`` exceeds the sum of the first seeds' attainments plus 1 plus the later
        seeds, less the seeds times ``floor + w`` (:class:`BarStop`). The run the stop leaves unstopped is
        the run without it; a run it stops rules the configuration out, as the best case of its seeds does."""
        met_bar, whole_bar, margin_bar = bar
        if not whole_bar or not math.isfinite(margin_bar):
            return None
        ran = pd.concat(rows, ignore_index=True)
        can_meet = bool(ran[names.STEADY].to_numpy(dtype=bool).all())
        floor = margin_bar if met_bar or not can_meet else min(margin_bar, 0.0)
        seeds, later = len(self.seeds), len(self.seeds) - len(rows) - 1
        spare = []
        for name, (column, _, wanted) in limit_checks(ran).items():
            attainments = ran[column].to_numpy(dtype=float)
            share = float(attainments.sum()) + 1 + later - seeds * (floor + wanted)
            if not np.isnan(attainments).any() and share < 1:
                spare.append((name, share))
        if not spare:
            return None
        base = missed_stop()
        return (met_bar, True, floor), BarStop(DECIDED_FAIL.min_requests if base is None else base.min_requests,
                                               tuple(spare), base)

    def _best_key(self, rows: list[pd.DataFrame], window: Window) -> tuple[bool, bool, float]:
        """The highest screen key (:func:`_screen_key`) a configuration can reach on every seed, from its first
        seeds' runs: its key with the other seeds' runs the best they could be (:func:`best_case`)."""
        ran = pd.concat(rows, ignore_index=True)
        return _screen_key(Judged(judge(best_case(ran, len(self.seeds))), ran, window))

    def _setting_fluid(self, point: dict) -> FluidModel | DisaggregatedFluid | None:
        """The fluid model of a point's setting (its rate and seed left out: a model of a workload with length
        laws of its own reads neither), built once per setting; None where it is not modelled (ConfigError),
        for :func:`~llmsim.search.window.typical_latency_s` to find so again."""
        setting = {k: v for k, v in point.items() if k not in (RATE_KEY, "seed")}
        key = json.dumps(setting, sort_keys=True, default=str)
        if key not in self._fluid:
            try:
                self._fluid[key] = fluid_model(variant(self.scenario, setting))
            except ConfigError:
                self._fluid[key] = None
        return self._fluid[key]

    def judge(self, points: list[dict], escalate: bool = True) -> list[Judged]:
        """Each point (one rate and seed) simulated over a window that follows its rate, longer while
        it passes undecided (:mod:`llmsim.search.window`); an undecided fail is taken as failed.
        ``escalate=False``: one window each, every verdict as that window leaves it."""
        rates = [point[RATE_KEY] for point in points]
        # A workload with length laws of its own has the fluid model read them, not a seed's sample: a point's
        # window is then the same for every seed, and worked out once for the search; and the model reads
        # neither the seed nor the rate, so a setting's serves every rate it is probed at (built once).
        seedless = has_length_law(self.scenario.workload)
        windows, known = [], self._windows
        for point, rate in zip(points, rates):
            key = json.dumps({k: v for k, v in point.items() if not (seedless and k == "seed")}, sort_keys=True,
                             default=str)
            if key not in known:
                at_rate = variant(self.scenario, point)
                fluid = self._setting_fluid(point) if seedless else None
                known[key] = measurement_window(at_rate, rate, typical_latency_s(at_rate, rate, fluid),
                                                own_floor=False)
            windows.append(known[key])
        return simulate_until_decided(self.scenario, points, windows, rates, workers=self.workers,
                                      progress=self.progress, escalations=ESCALATIONS if escalate else 0,
                                      escalate_failing=False)

    def simulate(self, points: list[dict]) -> pd.DataFrame:
        """The points simulated, each counted on the search's progress as it finishes."""
        return run_points(self.scenario, points, workers=self.workers, progress=self.progress)

    def best(self) -> Config:
        return self.table()["config"].iloc[0]

    def table(self) -> pd.DataFrame:
        frame = pd.DataFrame(list(self.results.values()))
        frame["default"] = [c in self.defaults for c in frame["config"]]
        # Once step 3b has chosen an expert-parallel degree (on cost), the settings at it rank first.
        frame["at_chosen_degree"] = self.expert_degree is None or frame["expert_parallel"] == self.expert_degree
        if self.objective is Objective.GOODPUT:
            order = frame.sort_values(["meets_scenario_rate", "at_chosen_degree", "max_rate_per_s"],
                                      ascending=[False, False, False], kind="stable")
        else:
            order = frame.sort_values(["meets_scenario_rate", "at_chosen_degree", "usd_per_million_output_tokens"],
                                      ascending=[False, False, True], kind="stable")
        return order.reset_index(drop=True)

    def at_scenario_rate(self, configs: Sequence[Config]) -> pd.DataFrame:
        configs = list(dict.fromkeys(configs))            # the best may be a default itself
        points = [{**c.overrides(self.scenario), "seed": s} for c in configs for s in self.seeds]
        rows = self.simulate(points)
        rows["setting"] = [c.label for c in configs for _ in self.seeds]
        metrics = [names.TTFT_P95, names.TPOT_P95, names.TTFT_P99, names.TPOT_P99, names.SLO_ATTAINMENT,
                   names.OUTPUT_TOKENS_PER_S]
        metrics += [f"{names.CLASSES}.{name}.{names.SLO_ATTAINMENT}" for name in self.scenario.workload.class_names]
        out = []
        for label, group in rows.groupby("setting", sort=False):
            entry = {"setting": label}
            for metric in metrics:
                values = group[metric].to_numpy(dtype=float)
                entry[metric], entry[f"{metric}.ci95"] = float(values.mean()), _ci(values)
            entry[names.SLO_MET] = bool(slo_met(group).all())
            verdict = judge(group.reset_index(drop=True))      # the tightest target, each class's own
            entry["worst_check"], entry["worst_margin"] = _worst_check(verdict), verdict.worst_margin[0]
            out.append(entry)
        return pd.DataFrame(out)


class _Bracket:
    """One (configuration, seed): the highest rate seen to pass and the lowest seen to fail."""

    def __init__(self):
        self.passing, self.failing = 0.0, math.inf
        self.usd_per_million = math.nan         # at the highest passing rate
        self.raced_out = False                  # stopped: it cannot be the best (``_Search.race``)
        self.probes: list[float] = []           # rates to simulate first, each while the bracket leaves it open
        self.step = 1.2                         # the factor it moves by until it brackets

    def next_rate(self, start: float, own: float, tolerance: float) -> float | None:
        """The next rate to simulate, or None when done. A setting that fails at the scenario's
        own rate cannot be recommended: its search stops there (goodput reported as 0)."""
        if self.raced_out:
            return None
        while self.probes:
            if self.passing < self.probes[0] < self.failing:
                return self.probes[0]
            self.probes.pop(0)
        if self.passing == 0.0 and self.failing == math.inf:
            return max(start, own)
        if self.failing == math.inf:
            return self.passing * self.step
        if self.passing == 0.0:
            return self.failing / self.step if self.failing > own else self._own(own)
        if self.failing > (1 + tolerance) * self.passing:
            return (self.passing + self.failing) / 2
        return self._own(own)

    def _own(self, own: float) -> float | None:
        """The scenario's own rate, when the bracket leaves open whether it passes."""
        if self.passing < own < self.failing:
            return own
        return None

    def record(self, rate: float, met: bool, row) -> None:
        if met and rate > self.passing:
            self.passing = rate
            self.usd_per_million = float(row[names.USD_PER_MILLION_OUTPUT_TOKENS])
        if not met and rate < self.failing:
            self.failing = rate

    def meets(self, own: float) -> bool:
        return own <= self.passing


def _policy_table(classes: ClassSearch, table: pd.DataFrame, at_rate: pd.DataFrame, scenario: Scenario) -> pd.DataFrame:
    """Per scheduling policy: its best class timeouts, their goodput, the screen's verdict at the probe
    rate and each class's attainment at the scenario's rate; best first (the search's own order)."""
    rows = table.set_index(table["config"].map(lambda c: c.label))
    by_label = at_rate.set_index("setting")
    screened = classes.screened.assign(key=classes.screened["class_timeouts"].map(lambda d: tuple(d.items())))
    out = []
    for policy, config in classes.best_per_policy.items():
        row, mine = rows.loc[config.label], by_label.loc[config.label]
        screen = screened[(screened["scheduling_policy"] == policy)
                          & (screened["key"] == tuple(config.class_timeouts))].iloc[0]
        entry = {"scheduling_policy": policy, "class_timeouts": dict(config.class_timeouts),
                 "max_rate_per_s": row["max_rate_per_s"], "max_rate_per_s.ci95": row["max_rate_per_s.ci95"],
                 "meets_scenario_rate": row["meets_scenario_rate"],
                 "screen_met": screen["met"], "screen_worst_check": screen["worst_check"],
                 "screen_worst_margin": screen["worst_margin"],
                 "worst_check": mine["worst_check"], "worst_margin": mine["worst_margin"]}
        for name in scenario.workload.class_names:
            column = f"{names.CLASSES}.{name}.{names.SLO_ATTAINMENT}"
            entry[column] = mine[column]
        out.append(entry)
    order = [config.policy for config in table["config"] if config in classes.best_per_policy.values()]
    return pd.DataFrame(out).set_index("scheduling_policy").loc[order].reset_index()


def _ci(values: np.ndarray, resolution: float = 0.0) -> float:
    """Half-width of the 95% Student-t confidence interval of the mean across seeds, and never below
    ``resolution``: a bisection's per-seed answers are known only to its bracket, so seeds that land in
    the same bracket agree to the bracket, not exactly (their spread alone would say +- 0)."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2 or not np.isfinite(values).all():      # an infinite gain (a baseline at 0) has no interval
        return math.nan
    return max(float(ci95_half_width(values.std(ddof=1), len(values))), float(resolution))
