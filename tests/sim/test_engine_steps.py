"""One scheduling step at a time, checked on the Iteration the engine returns.

Each test builds an engine by hand (no arrivals, no SimPy run), queues requests and
drives it step by step: ``schedule`` picks and prices an iteration, ``apply`` makes its
tokens appear. The expectations are worked out from the scheduling rules (vLLM V1 style
admission under ``max_batch_tokens`` and ``max_num_seqs``, KV in blocks of 16 tokens),
not read off the code's output.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import simpy

from llmsim.cost.roofline import CostModel
from llmsim.scenario.scenario import EngineConfig
from llmsim.sim.engine import Engine, reject_expired
from llmsim.sim.kvcache import KVCache
from llmsim.sim.request import Request, WaitingQueue
from llmsim.sim.speculative_decode import DecodeSlots, SpeculativeDecodeSet
from llmsim.speculation.config import Acceptance, KPolicy, SpeculationConfig
from llmsim.speculation.kernels import observe_windows
from llmsim.speculation.policies import AdaptiveK, GoodputK, k_policy
from llmsim.speculation.proposers import EAGLE, Proposer

from tests.helpers import make_scenario

BLOCK = 16


def build(num_blocks: int = 1000, decode=None, **config) -> Engine:
    scenario = make_scenario()
    cost = CostModel(scenario.model, scenario.hardware)
    extra = {} if decode is None else {"decode": decode}
    return Engine(simpy.Environment(), 0, cost, KVCache(num_blocks, BLOCK), WaitingQueue(), EngineConfig(**config),
                  lambda request, now: None, **extra)


def submit(engine: Engine, *sizes: tuple[int, int], arrival_s: float = 0.0) -> list[Request]:
    requests = [Request(i, arrival_s, prompt, output) for i, (prompt, output) in enumerate(sizes)]
    for request in requests:
        engine.queue.push(request, arrival_s)
    return requests


def step(engine: Engine):
    iteration = engine.schedule()
    engine.now += iteration.duration_s
    engine.apply(iteration)
    return iteration


def test_admission_stops_at_max_num_seqs_then_at_the_token_budget():
    engine = build(max_num_seqs=3, max_batch_tokens=1000)
    r = submit(engine, (300, 10), (300, 10), (300, 10), (300, 10))
    first = engine.schedule()
    # Three slots: three prompts of 300 join (900 of the 1000 tokens); the fourth waits for a slot.
    assert [(c[0].id, c[1]) for c in first.chunks] == [(0, 300), (1, 300), (2, 300)]
    assert (first.prefill_seqs, first.prefill_tokens, first.decode_seqs) == (3, 900, 0)
    assert (first.running, first.queued) == (3, 1)
    assert engine.kv.used_blocks == 3 * 19                 # ceil(300 / 16) = 19 blocks each
    assert engine.queue.head() is r[3]

    engine = build(max_num_seqs=8, max_batch_tokens=1000, chunked_prefill=False)
    submit(engine, (600, 10), (600, 10))
    # Without chunked prefill a prompt joins whole or not at all: 600 + 600 > 1000.
    assert [(c[0].id, c[1]) for c in engine.schedule().chunks] == [(0, 600)]


def test_chunked_prefill_splits_a_prompt_over_iterations():
    engine = build(max_batch_tokens=1000)
    r0, r1 = submit(engine, (600, 10), (600, 10))
    first = step(engine)
    # The second prompt gets what the first leaves of the budget: 1000 - 600.
    assert [(c[0].id, c[1]) for c in first.chunks] == [(0, 600), (1, 400)]
    assert first.tokens_out == 1                           # r0's prompt is complete: its first token
    assert (r0.generated, r1.prefilled, r1.generated) == (1, 400, 0)
    second = step(engine)
    # r0 decodes one token, which comes off the budget first; r1 finishes its last 200 positions.
    assert second.decode_seqs == 1 and second.decoding
    assert [(c[0].id, c[1]) for c in second.chunks] == [(1, 200)]
    assert second.tokens_out == 2 and r0.generated == 1   # r0's token is counted when its decode run closes
    assert r1.generated == 1 and r1.first_token_s == engine.now


def test_preemption_takes_the_latest_admitted_and_recomputes_prompt_plus_generated():
    # 4 blocks of 16: two sequences of prompt 16 fill one block each, take a second at their
    # first decode step and run out after 16 decode steps (context 32, two full blocks each).
    engine = build(num_blocks=4, max_batch_tokens=1000)
    r0, r1 = submit(engine, (16, 40), (16, 40))
    step(engine)                                           # both prompts; one token each
    assert engine.kv.used_blocks == 2
    for _ in range(16):
        assert step(engine).decode_seqs == 2
    assert engine.kv.used_blocks == 4 and engine.preemptions == 0
    iteration = step(engine)
    # Both need a third block; none is free: r1, admitted last, is preempted with 1 + 16 tokens.
    assert engine.preemptions == 1 and r1.preemptions == 1 and r0.preemptions == 0
    assert r1.status == "queued" and engine.queue.head() is r1
    assert r1.generated == 17 and r1.prefill_target == 16 + 17 and r1.prefilled == 0 and r1.blocks == 0
    # r0 alone decodes, holding three blocks; r1's recompute (3 blocks) does not fit the one left.
    assert iteration.decode_seqs == 1 and iteration.chunks == []
    assert engine.decode.blocks(r0) == 3 and engine.kv.used_blocks == 3


def held_as_the_rules_say(engine: Engine, started_with: dict[int, int]) -> None:
    """After an iteration's blocks are reserved: each decoding sequence holds the blocks of its KV with the step's
    token written, ``ceil((context + 1) / 16)``, or those it started decoding with where more (``started_with``,
    by request id); the cache has handed out what they and the prompts hold."""
    decode = engine.decode
    decoding = [r for r in engine.running.values() if r not in engine.prefilling]
    for r in decoding:
        assert decode.blocks(r) == max(-(-(decode.context(r) + 1) // BLOCK), started_with.get(r.id, 0))
    assert sum(decode.blocks(r) for r in engine.running.values()) == engine.kv.used_blocks


def test_a_sequence_holding_more_blocks_than_its_context_fills_takes_the_next_after_them():
    # r0 starts decoding holding 4 blocks (64 tokens; a disaggregated decode replica may reserve so) for a context of
    # 20: its next block falls due 44 steps on, past the block size, where it joins the count of its phase; r1 (16
    # tokens, 1 block) takes one every 16 steps from its first step on.
    engine = build(max_batch_tokens=1000)
    r0, r1 = submit(engine, (20, 70), (16, 70))
    iteration = engine.schedule()                          # both prompts, 2 + 1 blocks
    engine.kv.allocate(2)
    r0.blocks += 2
    engine.now += iteration.duration_s
    engine.apply(iteration)
    assert not engine.decode.dues_in_phase
    for _ in range(68):
        iteration = engine.schedule()
        held_as_the_rules_say(engine, {r0.id: 4})
        engine.now += iteration.duration_s
        engine.apply(iteration)
    assert engine.decode.blocks(r0) == -(-(20 + 68) // BLOCK) and engine.decode.blocks(r1) == -(-(16 + 68) // BLOCK)
    step(engine)                                           # both finish: every block back
    assert r0.status == r1.status == "finished" and engine.kv.used_blocks == 0


def test_a_sequence_due_at_a_step_whose_blocks_were_given_takes_its_block_at_the_step_s_next_reservation():
    # Step 0's blocks are reserved, then every decoder is preempted (as an admission after the reservation may):
    # the prompts admitted next complete at step 0, and r1 (32 tokens, 2 full blocks) is due its third block at
    # step 0 itself. It takes it at the next reservation, the step's, before the step runs.
    engine = build(max_batch_tokens=1000)
    r0, r1 = submit(engine, (20, 40), (32, 10))
    engine.queue.remove(r1)
    step(engine)                                           # r0's prompt: it decodes from step 0
    engine.decode.prepare(engine.now)                      # step 0's blocks (none due yet: 20 of 32 tokens)
    engine.preempt(r0, engine.now)
    engine.queue.push(r1, engine.now)
    step(engine)                                           # r0 recomputed (21 tokens) and r1's prompt
    assert engine.decode.step == 0 and engine.decode.blocks(r1) == 2 and engine.kv.used_blocks == 4
    while engine.running:
        iteration = engine.schedule()
        held_as_the_rules_say(engine, {})
        engine.now += iteration.duration_s
        engine.apply(iteration)
    assert r0.status == r1.status == "finished" and engine.kv.used_blocks == 0
    # Preempted before that reservation, it gives back the two blocks it holds.
    engine = build(max_batch_tokens=1000)
    r0, r1 = submit(engine, (20, 40), (32, 10))
    engine.queue.remove(r1)
    step(engine)
    engine.decode.prepare(engine.now)
    engine.preempt(r0, engine.now)
    engine.queue.push(r1, engine.now)
    step(engine)
    engine.preempt(r1, engine.now)
    assert r1.blocks == 0 and engine.kv.used_blocks == engine.decode.blocks(r0) == 2
    iteration = engine.schedule()
    held_as_the_rules_say(engine, {})


def test_a_timed_out_request_is_dispatched_past_the_budget_or_rejected():
    engine = build(max_batch_tokens=1000, queue_timeout_s=1.0, on_timeout="dispatch")
    big, small = submit(engine, (5000, 10), (500, 10))
    first = step(engine)
    assert [(c[0].id, c[1]) for c in first.chunks] == [(0, 1000)]     # the budget is spent on the big prompt
    engine.now = 0.5
    assert [(c[0].id, c[1]) for c in step(engine).chunks] == [(0, 1000)]
    engine.now = 1.0                                       # small has waited its timeout
    forced = engine.schedule()
    assert [(c[0].id, c[1]) for c in forced.chunks] == [(0, 1000), (1, 500)]
    assert forced.prefill_tokens == 1500                  # past max_batch_tokens

    queue, rejected = WaitingQueue(), []
    config = EngineConfig(queue_timeout_s=1.0, on_timeout="reject")
    old, started, young = Request(0, 0.0, 100, 10), Request(1, 0.2, 100, 10), Request(2, 1.5, 100, 10)
    started.first_scheduled_s = 0.3                        # preempted once: never expires
    for request in (started, old, young):
        queue.push(request, request.arrival_s)
    reject_expired(queue, config, 2.0, lambda request, now: rejected.append(request))
    assert rejected == [old]
    assert (old.status, old.reason, old.finish_s) == ("rejected", "timeout", 1.0)
    assert len(queue) == 2 and queue.head() is started


def test_a_speculative_step_reserves_k_plus_one_positions_and_rolls_back_to_the_accepted_context():
    spec = SpeculationConfig(None, policy=KPolicy("static", 4), acceptance=Acceptance("bernoulli", alpha=0.3))
    engine = build(max_batch_tokens=1000, decode=partial(SpeculativeDecodeSet, speculation=spec, draft_cost=None,
                                                         acceptance_key=7))
    requests = submit(engine, *[(111, 50)] * 4)
    for request in requests:
        request.alpha = 0.3
    step(engine)                                           # prompts: ceil(111 / 16) = 7 blocks each
    assert engine.kv.used_blocks == 4 * 7
    s = engine.decode.slots
    iteration = engine.schedule()
    # Context 111, k = 4: verifying writes positions up to 111 + 4 + 1 = 116, so 8 blocks each.
    assert (iteration.decode_seqs, iteration.spec_seqs, iteration.draft_tokens) == (4, 4, 16)
    assert list(s.k[:4]) == [4] * 4 and list(s.blocks[:4]) == [8] * 4
    assert engine.kv.used_blocks == 4 * 8
    engine.now += iteration.duration_s
    engine.apply(iteration)
    accepted = s.accepted[:4].copy()
    assert int(accepted.sum()) == iteration.accepted_tokens
    assert iteration.tokens_out == 4 + iteration.accepted_tokens
    # Each keeps its accepted prefix plus the target's own token; blocks shrink to that context.
    assert list(s.context[:4]) == list(111 + accepted + 1)
    assert list(s.blocks[:4]) == [-(-(111 + a + 1) // BLOCK) for a in accepted]
    assert engine.kv.used_blocks == int(s.blocks[:4].sum())
    assert (accepted == 0).any()                           # at alpha 0.3 some rejected every draft: 7 blocks


def tree_engine(max_batch_tokens: int, branching: int = 3, k: int = 3) -> Engine:
    """An engine whose decoders verify a full ``branching``-ary draft tree ``k`` levels deep (a free
    head: the draft's cost plays no part in the KV bookkeeping), four requests of (111, 50) in it,
    their prompts done (under a budget of 1000; ``max_batch_tokens`` from then on)."""
    spec = SpeculationConfig(None, policy=KPolicy("static", k), acceptance=Acceptance("bernoulli", alpha=0.3),
                             proposer=Proposer(EAGLE, branching=branching))
    engine = build(max_batch_tokens=1000, decode=partial(SpeculativeDecodeSet, speculation=spec, draft_cost=None,
                                                         acceptance_key=7))
    for request in submit(engine, *[(111, 50)] * 4):
        request.alpha = 0.3
    step(engine)                                           # prompts: ceil(111 / 16) = 7 blocks each
    engine.config = replace(engine.config, max_batch_tokens=max_batch_tokens)
    return engine


def test_a_tree_step_reserves_kv_for_every_node_and_keeps_only_the_accepted_path():
    """A ternary tree 3 levels deep has 3 + 9 + 27 = 39 nodes below its root, and the verify pass
    writes KV for the root and every node: positions up to 111 + 39 + 1 = 151, ceil(151 / 16) = 10
    blocks a sequence (a chain of the same depth would need ceil(115 / 16) = 8). After the step
    each sequence keeps its accepted path plus the target's token, context 111 + a + 1, and the
    blocks of every other node come back."""
    engine = tree_engine(max_batch_tokens=1000)
    s = engine.decode.slots
    iteration = engine.schedule()
    assert (iteration.decode_seqs, iteration.spec_seqs, iteration.draft_tokens) == (4, 4, 12)   # 3 levels each
    assert list(s.k[:4]) == [3] * 4 and list(s.blocks[:4]) == [10] * 4
    assert iteration.kv_used_blocks == engine.kv.used_blocks == 4 * 10
    freed_before = engine.kv.freed_total
    engine.now += iteration.duration_s
    engine.apply(iteration)
    accepted = s.accepted[:4].copy()
    assert int(accepted.sum()) == iteration.accepted_tokens and iteration.tokens_out == 4 + iteration.accepted_tokens
    assert list(s.context[:4]) == list(111 + accepted + 1)
    assert list(s.blocks[:4]) == [-(-(111 + a + 1) // BLOCK) for a in accepted]
    # At most 3 accepted: context <= 115, 8 blocks; the other (at least 2 a sequence) came back.
    assert engine.kv.used_blocks == int(s.blocks[:4].sum()) <= 4 * 8
    assert engine.kv.freed_total - freed_before == 4 * 10 - engine.kv.used_blocks


def test_a_tree_step_counts_every_node_against_the_token_budget():
    """Budget 100 tokens, four decoders: 96 tokens beyond their one each. A depth-3 ternary tree
    is 39 nodes (156 for four), over budget; depth 2 is 3 + 9 = 12 nodes (48): the common cap
    falls to k = 2 and the reservation to ceil((111 + 12 + 1) / 16) = 8 blocks. A chain at k = 3
    (12 tokens for four) would fit as it is."""
    engine = tree_engine(max_batch_tokens=100)
    s = engine.decode.slots
    iteration = engine.schedule()
    assert list(s.k[:4]) == [2] * 4 and iteration.draft_tokens == 8
    assert list(s.blocks[:4]) == [8] * 4 and iteration.kv_used_blocks == 32
    chain = tree_engine(max_batch_tokens=100, branching=1)
    assert list(chain.schedule() and chain.decode.slots.k[:4]) == [3] * 4


def test_the_adaptive_policy_moves_k_by_one_per_window_on_the_80_50_rule():
    policy = k_policy(KPolicy("adaptive", 4, k_max=8, window=2))
    assert isinstance(policy, AdaptiveK) and not policy.per_batch
    assert isinstance(k_policy(KPolicy("goodput", 4, scope="per_batch")), GoodputK)
    slots = DecodeSlots()
    slots.add(Request(0, 0.0, 100, 100), policy.initial_k)
    everyone = np.ones(1, dtype=bool)

    def round_(accepted: int) -> int:
        # The engine's step kernel applies the per-request rule with the policy's settings.
        k = policy.choose(slots, 1, everyone, None)
        observe_windows(1, k, np.array([accepted]), k > 0, slots.k_policy, slots.window_proposed,
                        slots.window_accepted, slots.window_rounds, slots.backoff, *policy.windows)
        return int(slots.k_policy[0])

    # Window of 2 rounds at k = 4: 8 of 8 accepted (100% > 80%): k = 5 after the second round.
    assert [round_(4), round_(4)] == [4, 5]
    # 2 of 10 accepted at k = 5 (20% < 50%): back to 4; 3 of 8 (37.5%): 3; 4 of 6 (67%): stays.
    assert [round_(1), round_(1)] == [5, 4]
    assert [round_(2), round_(1)] == [4, 3]
    assert [round_(2), round_(2)] == [3, 3]
