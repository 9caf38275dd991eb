"""Disaggregated prefill and decode: the settings of ``deployment.disaggregation``, read once.

A disaggregated deployment runs each prompt on a prefill pool and its decoding on a decode pool,
each with its own chip, tensor and pipeline parallelism and replica count; the prompt's KV cache
moves between them over a named link (:mod:`llmsim.catalog.links`). The simulation is in
:mod:`llmsim.sim.disaggregated`. With it, the scenario's own ``deployment`` (replicas,
parallelism, ``hardware``) is the aggregated layout of the same model that plans compare it with.

A pool may spread the routed experts over an expert-parallel group of its own (``expert_parallel``, the
same settings as ``deployment.expert_parallel``; the DeepSeek, Dynamo and SGLang layout is a wide group
decoding and a narrower one prefilling), and tune its engine apart (``engine``: ``max_num_seqs``,
``max_batch_tokens``, ``chunked_prefill``; the scenario's engine block where it sets none).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmsim.catalog.hardware import HardwareProfile
from llmsim.catalog.links import Link, lookup_link
from llmsim.config.policies import KVReservation
from llmsim.config.reader import Node, NumberRange
from llmsim.cost.experts import ExpertParallel
from llmsim.scenario.expert_parallel import expert_parallel_from_node

if TYPE_CHECKING:
    from llmsim.catalog.models import ModelSpec

POOLS = ("prefill", "decode")
POOL_ENGINE_KEYS = ("max_num_seqs", "max_batch_tokens", "chunked_prefill")


@dataclass(frozen=True)
class PoolEngine:
    """A pool's own engine settings; None: the scenario's ``engine`` block's."""
    max_num_seqs: int | None = None
    max_batch_tokens: int | None = None
    chunked_prefill: bool | None = None

    def settings(self) -> dict:
        """The settings this pool sets, by name (what it lays over the engine block)."""
        return {key: getattr(self, key) for key in POOL_ENGINE_KEYS if getattr(self, key) is not None}

    @classmethod
    def shared_by(cls, engine) -> PoolEngine:
        """The engine block's settings a pool takes where it sets none (``engine``: an EngineConfig)."""
        return cls(*(getattr(engine, key) for key in POOL_ENGINE_KEYS))


@dataclass(frozen=True)
class Pool:
    """One pool of a disaggregated deployment: ``replicas`` of ``tensor_parallel x pipeline_parallel``
    devices of ``hardware``; with ``expert_parallel`` a replica is an expert-parallel group of
    ``degree / tensor_parallel`` attention data-parallel ranks of that shape."""
    hardware: HardwareProfile
    replicas: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: ExpertParallel | None = None
    engine: PoolEngine = PoolEngine()
    # ``hardware`` where the scenario gave it (else it follows the scenario's).
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def data_parallel(self) -> int:
        return 1 if self.expert_parallel is None else self.expert_parallel.data_parallel(self.tensor_parallel)

    @property
    def devices_per_rank(self) -> int:
        """Devices of one serving engine group (an attention data-parallel rank with expert parallelism)."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def devices_per_replica(self) -> int:
        return self.devices_per_rank * self.data_parallel

    @property
    def devices(self) -> int:
        return self.replicas * self.devices_per_replica


@dataclass(frozen=True)
class Disaggregation:
    """Prefill pool, decode pool, the link between them, and how a request crosses it.

    ``streaming``: the KV is sent layer by layer while the prompt computes (LMCache's layer-wise
    mode, Mooncake's layer-wise prefill), so only the last layer's KV and what the link could not
    carry during the prefill are left once it ends. ``reservation``: when the decode replica takes the
    request's KV blocks (see :class:`~llmsim.config.policies.KVReservation`). A request whose prompt
    (with prefix caching, the part no prefill replica holds cached) is shorter than
    ``aggregated_below_tokens`` runs whole on a decode replica, as an aggregated engine would run it.
    """
    prefill: Pool
    decode: Pool
    link: Link
    streaming: bool = False
    reservation: KVReservation = KVReservation.BEFORE_TRANSFER
    aggregated_below_tokens: int = 0

    @property
    def lanes(self) -> int:
        """Link ports one transfer uses: one per device of the narrower engine group (each GPU of the
        replica, or of the data-parallel rank, holding the request's KV sends or receives its shard over
        its own port)."""
        return min(self.prefill.devices_per_rank, self.decode.devices_per_rank)

    @property
    def label(self) -> str:
        """``xPyD``: prefill and decode replicas."""
        return f"{self.prefill.replicas}P{self.decode.replicas}D"


def _default(cls: type, name: str):
    """A field's default, from its dataclass (a default lives in one place)."""
    return next(f.default for f in fields(cls) if f.name == name)


def disaggregation_from_node(node: Node, hardware_of: Callable[[Node, str], HardwareProfile],
                             model: ModelSpec, shared: PoolEngine, kernels: str) -> Disaggregation:
    """Read ``deployment.disaggregation``. ``hardware_of(pool_node, key)`` looks a pool's chip up (the
    scenario's ``hardware`` when the pool names none); the parallelism must divide the model's heads and
    not exceed its layers; ``shared`` holds the engine block's settings, which a pool's ``engine`` settings
    override, and ``kernels`` the engine whose kernels price a step. Whether each pool fits its chip is
    checked with the scenario."""
    num_heads, num_layers = model.num_heads, model.num_layers
    pools = []
    for name in POOLS:
        pool = node.child(name)
        hardware = hardware_of(pool, "hardware")
        replicas, tp, pp = (pool.number(key, _default(Pool, key), integer=True, minimum=1, exclusive_minimum=False)
                            for key in ("replicas", "tensor_parallel", "pipeline_parallel"))
        if num_heads % tp:
            raise pool.key_error("tensor_parallel", f"must divide the model's {num_heads} attention heads", tp,
                                 ", ".join(str(d) for d in range(1, num_heads + 1) if num_heads % d == 0))
        if pp > num_layers:
            raise pool.key_error("pipeline_parallel", f"cannot exceed the model's {num_layers} layers", pp,
                                 f"1..{num_layers}")
        experts = (expert_parallel_from_node(pool.child("expert_parallel"), model, tp, pp, hardware,
                                             kernels) if pool.has("expert_parallel") else None)
        own = _pool_engine(pool.child("engine", {}), name, shared)
        pool.done()
        pools.append(Pool(hardware, replicas, tp, pp, experts, own,
                          given=frozenset({"hardware"}) if pool.has("hardware") else frozenset()))
    link = lookup_link(node.string("link"), node, "link")
    streaming = node.boolean("streaming", _default(Disaggregation, "streaming"))
    reservation = KVReservation(node.choice("reservation", KVReservation.names(),
                                            _default(Disaggregation, "reservation")))
    below = node.number("aggregated_below_tokens", _default(Disaggregation, "aggregated_below_tokens"),
                        integer=True, minimum=0)
    node.done()
    return Disaggregation(pools[0], pools[1], link, streaming, reservation, below)


def check_pool_engines(split: Disaggregation, shared: PoolEngine, node: Node) -> None:
    """Each pool's own engine settings checked again with the engine block's ``shared`` ones, as the reader
    checks them (a variant that changes the engine block); ``node`` is ``deployment.disaggregation``'s."""
    for name in POOLS:
        _pool_engine(node.child(name).child("engine", getattr(split, name).engine.settings()), name, shared)


def _pool_engine(node: Node, name: str, shared: PoolEngine) -> PoolEngine:
    """A pool's ``engine`` settings, checked as the engine block's are with the shared block's for the rest;
    the decode pool continues each transferred prompt's last token as a chunk, so it must chunk."""
    count = NumberRange(integer=True, minimum=1, exclusive_minimum=False)
    own = PoolEngine(node.number("max_num_seqs", None, **count), node.number("max_batch_tokens", None, **count),
                     node.boolean("chunked_prefill") if node.has("chunked_prefill") else None)
    node.done()
    engine = replace(shared, **own.settings())
    assert engine.max_batch_tokens is not None and engine.max_num_seqs is not None    # the engine block sets both
    if (own.max_batch_tokens is not None or own.max_num_seqs is not None) \
            and engine.max_batch_tokens < engine.max_num_seqs:
        key = "max_batch_tokens" if own.max_batch_tokens is not None else "max_num_seqs"
        raise node.key_error(key, f"the {name} pool's max_batch_tokens ({engine.max_batch_tokens}) must be at least "
                             f"its max_num_seqs ({engine.max_num_seqs}), or some running sequences could never "
                             "decode", getattr(own, key), "max_batch_tokens >= max_num_seqs")
    if name == "decode" and own.chunked_prefill is False:
        raise node.key_error("chunked_prefill", "the decode pool continues each transferred prompt's last token as "
                             "a chunk (vLLM V1's scheduler)", False, "true")
    return own
