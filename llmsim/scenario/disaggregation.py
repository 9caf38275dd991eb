"""Disaggregated prefill and decode: the settings of ``deployment.disaggregation``, read once.

A disaggregated deployment runs each prompt on a prefill pool and its decoding on a decode pool,
each with its own chip, tensor and pipeline parallelism and replica count; the prompt's KV cache
moves between them over a named link (:mod:`llmsim.catalog.links`). The simulation is in
:mod:`llmsim.sim.disaggregated`. With it, the scenario's own ``deployment`` (replicas,
parallelism, ``hardware``) is the aggregated layout of the same model that plans compare it with.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from collections.abc import Callable

from llmsim.catalog.hardware import HardwareProfile
from llmsim.catalog.links import Link, lookup_link
from llmsim.config.policies import KVReservation
from llmsim.config.reader import Node

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Pool:
    """One pool of a disaggregated deployment: ``replicas`` of ``tensor_parallel x pipeline_parallel``
    devices of ``hardware``."""
    hardware: HardwareProfile
    replicas: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def devices_per_replica(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

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
        """Link ports one transfer uses: one per device of the narrower replica (each GPU sends or
        receives its shard of the KV over its own port)."""
        return min(self.prefill.devices_per_replica, self.decode.devices_per_replica)

    @property
    def label(self) -> str:
        """``xPyD``: prefill and decode replicas."""
        return f"{self.prefill.replicas}P{self.decode.replicas}D"


def _default(cls: type, name: str):
    """A field's default, from its dataclass (a default lives in one place)."""
    return next(f.default for f in fields(cls) if f.name == name)


def disaggregation_from_node(node: Node, hardware_of: Callable[[Node, str], HardwareProfile],
                             num_heads: int, num_layers: int) -> Disaggregation:
    """Read ``deployment.disaggregation``. ``hardware_of(pool_node, key)`` looks a pool's chip up (the
    scenario's ``hardware`` when the pool names none); the parallelism must divide ``num_heads`` and
    not exceed ``num_layers``. Whether each pool fits its chip is checked with the scenario."""
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
        pool.done()
        pools.append(Pool(hardware, replicas, tp, pp))
    link = lookup_link(node.string("link"), node, "link")
    streaming = node.boolean("streaming", _default(Disaggregation, "streaming"))
    reservation = KVReservation(node.choice("reservation", KVReservation.names(),
                                            _default(Disaggregation, "reservation")))
    below = node.number("aggregated_below_tokens", _default(Disaggregation, "aggregated_below_tokens"),
                        integer=True, minimum=0)
    node.done()
    return Disaggregation(pools[0], pools[1], link, streaming, reservation, below)
