"""What proposes the draft tokens, what it costs, and the candidate trees the target verifies.

A proposer turns a sequence's context into ``k`` draft tokens (a chain) or a tree of
candidates, ``branching`` children under every node, ``k`` levels deep. Kinds:

- ``model``: a separate small model (``speculation.draft: <model>``), its own weights and
  KV cache, ``k`` sequential decode steps, and it prefills every prompt the target prefills;
- ``eagle``: an EAGLE-style head (Li et al., ICML 2024, arXiv 2401.15077): one decoder layer
  of the target's shape fed the target's hidden states, plus a fully connected layer fusing
  features and token embeddings (2h x h), drafting ``k`` sequential steps through the
  target's own LM head. Its cost is one layer and the LM head per step; its memory one
  layer, the fusion layer and one layer of KV per token. It has no prefill of its own:
  its one layer over the prompt rides in the target's prefill iteration (priced as such);
- ``mtp``: a DeepSeek-V3 multi-token-prediction module (arXiv 2412.19437, section 2.2), the
  same structure as an EAGLE head but with the target's own layer (its MoE experts too),
  reused for each of the ``k`` steps as vLLM and SGLang do;
- ``medusa``: Medusa heads (Cai et al., ICML 2024, arXiv 2401.10774), ``heads`` residual
  blocks (h x h) each with its own LM head (h x vocab), all run once per step in parallel
  on the target's last hidden state: the draft costs one pass whatever ``k`` (k <= heads);
- ``ngram``: prompt lookup (Saxena 2023; vLLM's ``ngram`` method): no model, no memory;
  the search runs on the CPU between steps, serially with the GPU step (it is on the
  scheduler's critical path): ``cpu_s_per_sequence`` per speculating sequence plus
  ``cpu_s_per_context_token`` per token of its context, which the lookup scans
  (:data:`NGRAM_CPU_S_PER_CONTEXT_TOKEN`).

Heads live on the target's devices; only a ``model`` draft may have devices of its own.

Tree verification: every tree node is a token the target verifies (:func:`tree_tokens`);
the accepted length is the depth of the path the target follows (see
:mod:`llmsim.speculation.kernels`, ``tree_prefixes``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmsim.catalog.models import ModelSpec
from llmsim.config.policies import ProposerKind, members_of
from llmsim.cost.features import attention_pairs, decode_kv_read_of, decode_seqs_of
from llmsim.cost.roofline import shared_cost_model

MODEL, NGRAM, EAGLE, MTP, MEDUSA = (ProposerKind.MODEL, ProposerKind.NGRAM, ProposerKind.EAGLE, ProposerKind.MTP,
                                    ProposerKind.MEDUSA)
HEAD_KINDS = (EAGLE, MTP, MEDUSA)
# vLLM's n-gram lookup scans each speculating sequence's whole context on the CPU every step. Measured:
# 512 sequences x 129,536 tokens (66.3M tokens scanned per step) took 70.28 ms on one thread per rank
# (vLLM main, 4x H100 host; vllm-project/vllm PR 56732, "Add Tensor Parallel Ngram-CPU decoding"):
# 1.06 ns per context token. With 8 threads (vLLM's cap, PR 24986, when the host has the cores) it was
# 9.95 ms, 0.15 ns per token: set ``ngram_cpu_per_context_token`` to that for such a host.
NGRAM_CPU_S_PER_CONTEXT_TOKEN = 70.28e-3 / (512 * 129_536)


@dataclass(frozen=True)
class HeadSpec(ModelSpec):
    """A draft head on the target's hidden states: ``num_layers`` decoder layers of the target's
    shape plus ``extra_params`` of its own (EAGLE's fusion layer, Medusa's blocks and LM heads);
    embedding and LM head are the target's, shared, so they add no weights.

    The cost model prices its layers and an LM head read per step (``vocab_size``) as for any
    model; :attr:`param_count` counts only the weights the head adds to the devices.
    """

    extra_params: int = 0

    def _as_model(self) -> ModelSpec:
        return ModelSpec(**{name: getattr(self, name) for name in ModelSpec.__dataclass_fields__})

    @property
    def param_count(self) -> int:
        model = self._as_model()
        shared = model.embedding_params + model.lm_head_params + model.hidden_size   # and the final norm
        return model.param_count - shared + self.extra_params

    @property
    def weight_bytes(self) -> float:
        model = self._as_model()
        shared = (model.embedding_params + model.lm_head_params) * model.embedding_bytes_per_param
        return (model.weight_bytes - shared - model.hidden_size * model.weight_bytes_per_param
                + self.extra_params * model.weight_bytes_per_param)


def head_spec(kind: ProposerKind, target: ModelSpec, heads: int = 0) -> HeadSpec:
    """The draft head of ``kind`` for ``target`` (see the module docstring)."""
    hidden = target.hidden_size
    fields = {f: getattr(target, f) for f in ModelSpec.__dataclass_fields__}
    fields.update(name=f"{target.name}:{kind}", source=f"{kind} head of {target.name}", params_published=None)
    if kind == EAGLE:
        # A dense layer (EAGLE heads on MoE targets are dense, as in the released checkpoints).
        fields.update(num_layers=1, num_experts=1, experts_per_token=1, dense_layers=0,
                      moe_intermediate_size=0, shared_expert_intermediate_size=0)
        return HeadSpec(**fields, extra_params=2 * hidden * hidden)
    if kind == MTP:
        fields.update(num_layers=1, dense_layers=0)          # DeepSeek-V3's MTP block is an MoE layer
        return HeadSpec(**fields, extra_params=2 * hidden * hidden)
    # Medusa: no attention layer, no KV; its cost is priced by MedusaCost, not a layer.
    fields.update(num_layers=0, dense_layers=0)
    return HeadSpec(**fields, extra_params=heads * (hidden * hidden + hidden * target.vocab_size))


@dataclass(frozen=True)
class Proposer:
    """The configured proposer (see the module docstring)."""
    kind: ProposerKind = NGRAM
    heads: int = 0                       # medusa: how many heads (the longest draft)
    branching: int = 1                   # children per tree node; 1 is a chain
    cpu_s_per_sequence: float = 0.0      # ngram: CPU search time per speculating sequence per step
    cpu_s_per_context_token: float = NGRAM_CPU_S_PER_CONTEXT_TOKEN   # ngram: and per token of its context

    def __post_init__(self) -> None:
        members_of(self, kind=ProposerKind)

    @property
    def max_k(self) -> int | None:
        """The longest draft it can propose: Medusa one token per head; None where there is no such
        bound (a model, a lookup, and EAGLE and MTP heads, which are reused for every drafted token)."""
        return self.heads if self.kind == MEDUSA else None

    @property
    def sequential(self) -> bool:
        """Whether the draft takes one step per drafted level (all but Medusa and n-gram)."""
        return self.kind in (MODEL, EAGLE, MTP)


def tree_tokens(k, branching: int):
    """Tree nodes below the root of a full ``branching``-ary tree ``k`` levels deep:
    ``sum_{j=1..k} b^j`` (``k`` for a chain). Works on arrays."""
    k = np.asarray(k)
    if branching == 1:
        return k
    return (branching ** (k + 1) - branching) // (branching - 1)


def tree_verify_pairs(k, branching: int, seen, steps=1):
    """Query-key pairs of verifying a full ``branching``-ary tree ``k`` levels deep after ``seen``
    cached tokens (``seen`` summed over ``steps`` steps): under the tree attention mask the root
    attends to ``seen + 1`` keys and a node at depth j to ``seen + j + 1`` (the context, its
    ancestors and itself), ``sum_{j=0..k} b^j (seen + j + 1)``. A chain (b = 1) is one chunk of
    ``k + 1`` positions, :func:`~llmsim.cost.features.attention_pairs`. Works on arrays of k."""
    k = np.asarray(k)
    if branching == 1:
        return attention_pairs(k + 1, seen, steps)
    depth = np.arange(int(np.max(k, initial=0)) + 1)
    ancestors = np.cumsum(float(branching) ** depth * (depth + 1))     # sum_{j<=k} b^j (j + 1)
    return (tree_tokens(k, branching) + 1) * seen + ancestors[k] * steps


def level_acceptance(alpha, branching: int):
    """The chance that one of a node's ``branching`` children is the target's token, each
    being it with chance ``alpha`` independently: ``1 - (1 - alpha)^b`` (``alpha`` itself, to the
    bit, for a chain)."""
    alpha = np.asarray(alpha, dtype=float)
    return alpha if branching == 1 else 1.0 - (1.0 - alpha) ** branching


class MedusaCost:
    """The roofline of Medusa's heads: one pass per step over the speculating sequences.

    Each head reads its block (h x h) and its LM head (h x vocab) once per step and computes
    2 FLOPs per parameter per sequence; the time is the larger of the two at the device's
    efficiencies, plus the per-step overhead, on ``tp`` devices. It takes feature rows as a
    :class:`~llmsim.cost.roofline.CostModel` does, each row one pass over its ``decode_seqs``
    (the simulator gives it one row a step: the heads do not run sequentially).
    """

    def __init__(self, head: HeadSpec, hardware, tensor_parallel: int):
        self.model = head
        compute_efficiency, _, memory_efficiency = hardware.efficiencies_for(head.weight_dtype)
        self.params_per_device = head.extra_params / tensor_parallel
        self._weight_bytes = self.params_per_device * head.weight_bytes_per_param
        self._s_per_byte = 1.0 / (hardware.memory_bandwidth_bytes_per_s * memory_efficiency)
        self._s_per_flop = 1.0 / (hardware.peak_for(head.weight_dtype) * compute_efficiency)
        self._overhead_s = hardware.per_step_overhead_s
        self._tp = tensor_parallel

    def pass_cost(self, sequences):
        """(time_s, FLOPs, bytes) of one pass of the heads over ``sequences`` sequences."""
        sequences = np.asarray(sequences, dtype=float)
        flops = 2.0 * self.params_per_device * sequences
        time_s = np.where(sequences > 0, np.maximum(flops * self._s_per_flop, self._weight_bytes * self._s_per_byte)
                          + self._overhead_s, 0.0)
        return time_s, flops * self._tp, np.where(sequences > 0, self._weight_bytes * self._tp, 0.0)

    def iteration(self, rows):
        return self.pass_cost(decode_seqs_of(np.asarray(rows)))


class NgramCost:
    """The CPU time of an n-gram search, once per step, whatever k (the lookup returns up to k tokens at
    once): ``cpu_s_per_sequence`` per sequence that drafts plus ``cpu_s_per_context_token`` per token of
    the contexts it scans (the rows' decode KV read: with a sliding window, the window, which under-counts
    the lookup). No FLOPs or bytes on the accelerator. Takes rows as :class:`MedusaCost` does (one a step)."""

    model = None

    def __init__(self, cpu_s_per_sequence: float, cpu_s_per_context_token: float):
        self.cpu_s_per_sequence, self.cpu_s_per_context_token = cpu_s_per_sequence, cpu_s_per_context_token

    def iteration(self, rows):
        rows = np.asarray(rows)
        time_s = decode_seqs_of(rows) * self.cpu_s_per_sequence + decode_kv_read_of(rows) * self.cpu_s_per_context_token
        return time_s, np.zeros_like(time_s), np.zeros_like(time_s)


def draft_cost_model(proposer: Proposer, draft: ModelSpec | None, hardware, tensor_parallel: int, placement):
    """The draft's cost: a CostModel for a model or a layer head, MedusaCost, NgramCost, or None
    (a free n-gram search)."""
    if proposer.kind == NGRAM:
        free = proposer.cpu_s_per_sequence == 0 and proposer.cpu_s_per_context_token == 0
        return None if free else NgramCost(proposer.cpu_s_per_sequence, proposer.cpu_s_per_context_token)
    assert draft is not None, "a model or head proposer has a draft"
    if proposer.kind == MEDUSA:
        assert isinstance(draft, HeadSpec)          # the reader builds Medusa's heads with head_spec
        return MedusaCost(draft, hardware, tensor_parallel)
    return shared_cost_model(draft, hardware, tensor_parallel, 1, placement)
