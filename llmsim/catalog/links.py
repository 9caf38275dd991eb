"""Named links a disaggregated deployment moves KV caches over, with where each figure comes from.

A link here is one port per device, one direction: a prefill replica of ``n`` devices sends its
request's KV over ``n`` of them at once (one NIC or NVLink port per GPU, as in a DGX H100 node with one
ConnectX-7 per GPU), so the simulator multiplies :attr:`Link.bandwidth_bytes_per_s` by the lanes a
transfer uses (:mod:`llmsim.sim.disaggregated`). A transfer of ``b`` bytes alone on a link of ``lanes``
ports takes ``b / (lanes x bandwidth x efficiency) + latency``; transfers that share it share its
bandwidth.

Bandwidths are datasheet line rates. Efficiencies are measured where a measurement is named and
assumptions otherwise; every latency is an assumption (no public per-transfer figure for a KV
hand-off): each ``source`` says which. Edit the table, or pick another link, for your fabric.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from llmsim.catalog.hardware import Figure
from llmsim.config.reader import Node

GB = 1e9


@dataclass(frozen=True)
class Link:
    """One port of a link, one direction, per device."""
    name: str
    description: str
    bandwidth_bytes_per_s: float        # line rate, one direction, per port
    efficiency: float                   # achieved / line rate for large transfers
    latency_s: float                    # fixed cost per transfer (set-up, completion notice)
    figures: dict[str, Figure]

    @property
    def effective_bytes_per_s(self) -> float:
        """What one port carries of a large transfer: line rate x efficiency."""
        return self.bandwidth_bytes_per_s * self.efficiency

    def transfer_s(self, nbytes: float, lanes: int = 1) -> float:
        """Seconds to move ``nbytes`` alone over ``lanes`` ports: bytes / (bandwidth x efficiency) + latency."""
        rate = self.effective_bytes_per_s * lanes
        return (0.0 if math.isinf(rate) else nbytes / rate) + self.latency_s


def _link(name: str, description: str, bandwidth: tuple[float, str, str], efficiency: tuple[float, str, str],
          latency: tuple[float, str, str]) -> Link:
    figures = {key: Figure(source, confidence) for key, (_, source, confidence)
               in (("bandwidth", bandwidth), ("efficiency", efficiency), ("latency", latency))}
    return Link(name, description, bandwidth[0], efficiency[0], latency[0], figures)


_RDMA_LATENCY = (10e-6, "assumption: one RDMA write of a KV block list plus its completion notice (NIXL, Mooncake "
                        "Transfer Engine); no public per-transfer figure", "assumption")
_NVLINK_LATENCY = (5e-6, "assumption: a peer-to-peer copy's launch and completion within a node or NVLink domain; "
                         "no public per-transfer figure", "assumption")
_PCIE_LATENCY = (10e-6, "assumption: a copy-engine transfer's launch and completion over PCIe; no public "
                        "per-transfer figure", "assumption")
_NVLINK_EFFICIENCY = (0.83, "measured: H100 NVLink peer-to-peer 749 of 900 GB/s bidirectional (83%), NVIDIA/nccl "
                            "issue 1264 (the H100-SXM profile's interconnect efficiency)", "measured")
_RDMA_NIC_EFFICIENCY = (0.94, "measured: RDMA of host memory over one 400 Gbps NIC at about 47 of 50 GB/s, 'near line "
                              "rate' (Mooncake docs, GPUDirect RDMA bandwidth optimization guide; GPU memory reaches "
                              "the same once PCIe relaxed ordering is on)", "measured")

LINKS: dict[str, Link] = {link.name: link for link in (
    _link("nvlink4", "NVLink 4 (H100, H200): 18 links per GPU through NVSwitch, within a node or NVL domain",
          (450 * GB, "NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s bidirectional per GPU, 450 GB/s each "
                     "way", "datasheet"), _NVLINK_EFFICIENCY, _NVLINK_LATENCY),
    _link("nvlink5", "NVLink 5 (B200, GB200 NVL72): within a node or NVL72 rack",
          (900 * GB, "NVIDIA Blackwell (HGX B200) datasheet: NVLink 1.8 TB/s bidirectional per GPU, 900 GB/s each "
                     "way", "datasheet"),
          (0.83, "assumption: transferred from the H100 NVLink measurement (83%, NVIDIA/nccl issue 1264)",
           "assumption"), _NVLINK_LATENCY),
    _link("nvlink_c2c", "NVLink-C2C (GH200, GB200): the Grace CPU to Hopper/Blackwell GPU link of one superchip",
          (450 * GB, "NVIDIA GH200 Grace Hopper Superchip datasheet: NVLink-C2C 900 GB/s bidirectional, 450 GB/s "
                     "each way", "datasheet"),
          (0.83, "assumption: taken to match the NVLink peer-to-peer measurement (83%, NVIDIA/nccl issue 1264)",
           "assumption"), _NVLINK_LATENCY),
    _link("infiniband_ndr", "InfiniBand NDR, 400 Gb/s per port (ConnectX-7, Quantum-2), one port per GPU",
          (50 * GB, "NVIDIA ConnectX-7 / Quantum-2 datasheets: NDR 400 Gb/s per port = 50 GB/s", "datasheet"),
          _RDMA_NIC_EFFICIENCY, _RDMA_LATENCY),
    _link("infiniband_xdr", "InfiniBand XDR, 800 Gb/s per port (ConnectX-8, Quantum-X800), one port per GPU",
          (100 * GB, "NVIDIA ConnectX-8 SuperNIC / Quantum-X800 datasheets: XDR 800 Gb/s per port = 100 GB/s",
           "datasheet"),
          (0.94, "assumption: the 400 Gbps RDMA NIC measurement (about 47 of 50 GB/s, Mooncake docs) carried over",
           "assumption"), _RDMA_LATENCY),
    _link("roce_400g", "RoCE v2 over 400 GbE (ConnectX-7, Spectrum-X), one port per GPU",
          (50 * GB, "400 GbE = 50 GB/s per port (IEEE 802.3ck/df; NVIDIA ConnectX-7 datasheet)", "datasheet"),
          (0.475, "measured: Mooncake Transfer Engine moved a 40 GB KV cache at 190 GB/s over 8 x 400 Gbps RoCE "
                  "(400 GB/s of line rate; Mooncake README)", "measured"), _RDMA_LATENCY),
    _link("roce_200g", "RoCE v2 over 200 GbE, one port per GPU",
          (25 * GB, "200 GbE = 25 GB/s per port (IEEE 802.3bs)", "datasheet"),
          (0.87, "measured: Mooncake Transfer Engine moved a 40 GB KV cache at 87 GB/s over 4 x 200 Gbps RoCE "
                 "(100 GB/s of line rate; Mooncake README)", "measured"), _RDMA_LATENCY),
    _link("pcie_gen5", "PCIe 5.0 x16 (through host memory or a PCIe switch)",
          (63 * GB, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b encoding = 63 GB/s each way (PCI-SIG)",
           "datasheet"),
          (0.83, "measured: nvbandwidth device_to_host_memcpy on an H100 node reached 52.8 of 63 GB/s "
                 "(NVIDIA/nvbandwidth issue 24; the H100-SXM profile's host link)", "measured"), _PCIE_LATENCY),
    _link("pcie_gen4", "PCIe 4.0 x16",
          (31.5 * GB, "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b encoding = 31.5 GB/s each way (PCI-SIG)",
           "datasheet"),
          (0.83, "assumption: the PCIe 5.0 measurement's share (NVIDIA/nvbandwidth issue 24) carried over",
           "assumption"), _PCIE_LATENCY),
)}


def lookup_link(name: str, node: Node | None = None, key: str = "link") -> Link:
    """A link of :data:`LINKS` by name (case-insensitive, ``-`` read as ``_``); a ConfigError naming ``key``
    for any other name."""
    wanted = name.lower().replace("-", "_") if isinstance(name, str) else name
    if wanted in LINKS:
        return LINKS[wanted]
    message = "unknown link"
    hint = difflib.get_close_matches(str(wanted), list(LINKS), n=1, cutoff=0.4)
    if hint:
        message += f"; did you mean '{hint[0]}'?"
    allowed = ", ".join(LINKS)
    if node is None:
        raise ValueError(f"{message}: {name!r} (allowed: {allowed})")
    raise node.key_error(key, message, name, allowed)
