"""Accelerators as the roofline sees them: peak FLOP/s, memory, bandwidth, links, overheads.

Profiles live in ``hardware_profiles/*.yaml``, one chip per file. Every figure
is written as ``{value: ..., source: ..., confidence: ...}`` so the origin of a
number travels with it: ``datasheet`` (vendor specification), ``measured``
(a benchmark or a calibration, named), ``unverified`` (reported, not confirmed
from a primary source) or ``assumption`` (a default a user should replace).
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import os
from importlib import resources
from dataclasses import dataclass, field, replace
from pathlib import Path

from llmsim.catalog.kernel_terms import ENGINE_NAMES, KernelTerms, engine_kernel_terms
from llmsim.config.reader import Node, NumberRange, parse_yaml, read_text
from llmsim.errors import ConfigError

CONFIDENCE = ("datasheet", "measured", "unverified", "assumption")


@dataclass(frozen=True)
class Figure:
    """Where a number came from."""
    source: str
    confidence: str


@dataclass(frozen=True)
class MemoryTier:
    """One level of a device's memory: on-chip SRAM, HBM, or an outer store (host DDR, MemoryX)."""
    name: str
    capacity_bytes: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class HostMemory:
    """The host memory a device can hold KV blocks in, and the link that reaches it (per device).

    ``capacity_bytes`` is the device's share of its server's memory; ``link_bandwidth_bytes_per_s``
    one direction of its host link (PCIe, NVLink-C2C), as a copy achieves it.
    """
    link: str
    capacity_bytes: float
    link_bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator chip (per device; a deployment multiplies it)."""

    name: str
    description: str
    peak_flops_per_s: dict[str, float]
    memory_capacity_bytes: float
    memory_bandwidth_bytes_per_s: float
    interconnect_bandwidth_bytes_per_s: float   # per device, one direction
    interconnect_latency_s: float
    tdp_w: float
    price_per_hour_usd: float
    compute_efficiency: float                   # achieved / peak for large GEMMs
    attention_efficiency: float                 # achieved / peak for attention kernels
    memory_efficiency: float                    # achieved / peak streaming bandwidth
    interconnect_efficiency: float              # achieved / peak all-reduce bus bandwidth
    per_step_overhead_s: float                  # scheduler, sampling, launch: once per iteration
    per_layer_overhead_s: float                 # kernel launches: once per layer per iteration
    kv_read_penalty: float = 1.0                # KV bytes actually moved per KV byte read (paged gathers)
    # Dataflow chips (wafer-scale SRAM): a layer's time grows with its width, the token's vector crossing
    # the cores that hold the layer; seconds per hidden element per layer, on top of per_layer_overhead_s.
    per_layer_per_hidden_element_s: float = 0.0
    # Decode attention of a sequence with context c runs at attention_efficiency * c / (c + this):
    # a fixed cost per sequence and layer (0: none, efficiency independent of context).
    attention_half_context: float = 0.0
    # Kernels differ by dtype (e.g. AMX bf16 tiles vs AVX-512 fp32 on a CPU): {dtype: {"compute": ..,
    # "attention": .., "memory_bandwidth": ..}} overrides the efficiencies above for models in that dtype.
    efficiency_by_dtype: dict[str, dict[str, float]] = field(default_factory=dict)
    memory_name: str = "HBM"                    # what the primary memory is (SRAM on wafer-scale chips)
    outer_tiers: tuple[MemoryTier, ...] = ()    # slower, larger memories beyond the primary one
    host_memory: HostMemory | None = None       # host memory for KV blocks (offload, swap), if the profile says
    calibration: dict = field(default_factory=dict, compare=False)   # how the efficiencies were measured
    # A machine-specific profile (written by ``llmsim calibrate``): the CPU or GPU model it was measured on,
    # as the operating system or driver names it. None: a chip's profile, meant for every machine with it.
    machine: str | None = None
    # Other names the chip goes by (H100 for H100-SXM): lookups by name take them too.
    aliases: tuple[str, ...] = ()
    # Measured kernel terms (floors, shape-aware GEMMs, collectives): None prices by the plain roofline.
    kernels: KernelTerms | None = None
    # Other engines' kernel terms ({"sglang": ..., "trtllm": ...}); ``kernels`` is the default engine's (vLLM's).
    engine_kernels: dict[str, KernelTerms] = field(default_factory=dict, compare=False)
    figures: dict[str, Figure] = field(default_factory=dict, compare=False)
    path: str | None = field(default=None, compare=False)
    # The name or file path it was looked up by (:func:`lookup_hardware`), as a scenario's ``hardware`` writes it.
    named: str | None = field(default=None, compare=False, repr=False)

    @property
    def tiers(self) -> tuple[MemoryTier, ...]:
        """Memory tiers, innermost (fastest) first; the first is the primary memory."""
        primary = MemoryTier(self.memory_name, self.memory_capacity_bytes, self.memory_bandwidth_bytes_per_s)
        return (primary,) + self.outer_tiers

    def for_engine(self, engine) -> HardwareProfile:
        """This profile priced by ``engine``'s kernels (an EngineKernels) where it has them of its own (the scenario
        checks it does for any but the default engine, whose terms are ``kernels``)."""
        own = self.engine_kernels.get(engine.value)
        return self if own is None else replace(self, kernels=own)

    def efficiencies_for(self, dtype: str) -> tuple[float, float, float]:
        """(compute, attention, memory) efficiencies for a model whose weights are in ``dtype``."""
        own = self.efficiency_by_dtype.get(dtype, {})
        return (own.get("compute", self.compute_efficiency), own.get("attention", self.attention_efficiency),
                own.get("memory_bandwidth", self.memory_efficiency))

    def peak_for(self, dtype: str) -> float:
        """Dense peak for GEMMs in ``dtype``; weight-only formats compute in bf16."""
        if dtype in self.peak_flops_per_s:
            return self.peak_flops_per_s[dtype]
        for fallback in ("bf16", "fp16"):
            if fallback in self.peak_flops_per_s:
                return self.peak_flops_per_s[fallback]
        return max(self.peak_flops_per_s.values())


def _in_document(data: dict, key_path: str) -> bool:
    """Whether the dotted ``key_path`` (group sizes as digits) is written in the profile ``data``."""
    for part in key_path.split("."):
        if not isinstance(data, dict):
            return False
        key = next((k for k in data if str(k) == part), None)
        if key is None:
            return False
        data = data[key]
    return True


def _figure(node: Node, key: str, kind: str | None, figures: dict, **limits) -> float:
    """Read ``key: {value, source, confidence}``; ``kind`` is a unit kind or None for a plain number."""
    entry = node.child(key)
    value = entry.number("value", **limits) if kind is None else entry.quantity("value", kind, **limits)
    source = entry.string("source")
    confidence = entry.choice("confidence", CONFIDENCE)
    entry.done(extra_allowed=("note",))
    figures[node.key_path(key)] = Figure(source, confidence)
    return value


def profile_from_node(node: Node, path: str | None = None) -> HardwareProfile:
    figures: dict[str, Figure] = {}
    fraction = NumberRange(minimum=0.0, maximum=1.0, exclusive_minimum=True)
    peaks_node = node.child("peak_flops")
    peaks = {dtype: _figure(peaks_node, dtype, "flops", figures) for dtype in list(peaks_node.data)}
    if not peaks:
        raise node.key_error("peak_flops", "needs at least one dtype", {}, "bf16, fp16, fp8, int8, fp4, fp32")
    peaks_node.done()
    eff = node.child("efficiency")
    overhead = node.child("overhead")
    engine_figures: dict[str, Figure] = {}
    kernels, engine_kernels = engine_kernel_terms(
        node, lambda entry, key, kind, **limits: _figure(entry, key, kind, figures, **limits),
        lambda entry, key, kind, **limits: _figure(entry, key, kind, engine_figures, **limits), ENGINE_NAMES)
    # An engine's terms are its overlay laid over the section: the figures it inherits are the section's own.
    figures.update({key: figure for key, figure in engine_figures.items() if _in_document(node.data, key)})
    profile = HardwareProfile(
        name=node.string("name"),
        description=node.string("description", ""),
        peak_flops_per_s=peaks,
        memory_capacity_bytes=_figure(node, "memory_capacity", "bytes", figures),
        memory_bandwidth_bytes_per_s=_figure(node, "memory_bandwidth", "bandwidth", figures),
        interconnect_bandwidth_bytes_per_s=_figure(node, "interconnect_bandwidth", "bandwidth", figures),
        interconnect_latency_s=_figure(node, "interconnect_latency", "duration", figures, minimum=0.0,
                                       exclusive_minimum=False),
        tdp_w=_figure(node, "tdp", "power", figures),
        price_per_hour_usd=_figure(node, "price_per_hour_usd", None, figures, minimum=0.0),
        compute_efficiency=_figure(eff, "compute", None, figures, **fraction),
        attention_efficiency=_figure(eff, "attention", None, figures, **fraction),
        memory_efficiency=_figure(eff, "memory_bandwidth", None, figures, **fraction),
        interconnect_efficiency=_figure(eff, "interconnect", None, figures, **fraction),
        kv_read_penalty=(_figure(eff, "kv_read_penalty", None, figures, minimum=1.0, exclusive_minimum=False)
                         if eff.has("kv_read_penalty") else 1.0),
        attention_half_context=(_figure(eff, "attention_half_context", None, figures, minimum=0.0,
                                        exclusive_minimum=False) if eff.has("attention_half_context") else 0.0),
        efficiency_by_dtype=_efficiency_by_dtype(eff, peaks, figures, fraction),
        calibration=_calibration(node),
        machine=node.string("machine", None),
        aliases=_aliases(node),
        kernels=kernels, engine_kernels=engine_kernels,
        memory_name=node.string("memory_name", "HBM"),
        outer_tiers=_outer_tiers(node, figures),
        host_memory=_host_memory(node, figures),
        per_step_overhead_s=_figure(overhead, "per_step", "duration", figures, minimum=0.0,
                                    exclusive_minimum=False),
        per_layer_overhead_s=_figure(overhead, "per_layer", "duration", figures, minimum=0.0,
                                     exclusive_minimum=False),
        per_layer_per_hidden_element_s=(_figure(overhead, "per_layer_per_hidden_element", "duration", figures,
                                                minimum=0.0, exclusive_minimum=False)
                                        if overhead.has("per_layer_per_hidden_element") else 0.0),
        figures=figures,
        path=path,
    )
    eff.done()
    overhead.done()
    node.done()
    return profile


def _aliases(node: Node) -> tuple[str, ...]:
    """``aliases: [H100, ...]``: other names of the chip, each a non-empty string."""
    names = node.raw("aliases", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise node.key_error("aliases", "expected a list of names", names, "a list of strings, e.g. [H100, H100-80GB]")
    return tuple(n.strip() for n in names)


def _efficiency_by_dtype(eff: Node, peaks: dict, figures: dict, fraction: NumberRange) -> dict[str, dict[str, float]]:
    """``efficiency.by_dtype: {dtype: {compute, attention, memory_bandwidth}}``, each entry optional;
    a dtype needs a peak_flops entry."""
    if not eff.has("by_dtype"):
        return {}
    by_dtype = eff.child("by_dtype")
    result = {}
    for dtype in list(by_dtype.data):
        if dtype not in peaks:
            raise by_dtype.key_error(str(dtype), "no peak_flops entry for this dtype", by_dtype.data[dtype],
                                     "a dtype of peak_flops: " + ", ".join(peaks))
        entry = by_dtype.child(dtype)
        result[dtype] = {key: _figure(entry, key, None, figures, **fraction)
                         for key in ("compute", "attention", "memory_bandwidth") if entry.has(key)}
        entry.done()
    by_dtype.done()
    return result


def _outer_tiers(node: Node, figures: dict) -> tuple[MemoryTier, ...]:
    """``outer_memory: [{name, capacity: {value, source, confidence}, bandwidth: {...}}, ...]``."""
    raw = node.raw("outer_memory", [])
    if not isinstance(raw, list):
        raise node.key_error("outer_memory", "expected a list of memory tiers", raw,
                             "a list of {name, capacity, bandwidth}, innermost first")
    tiers = []
    for index, entry in enumerate(raw):
        tier = Node(entry, file=node.file, path=node.key_path(f"outer_memory[{index}]"))
        tiers.append(MemoryTier(tier.string("name"), _figure(tier, "capacity", "bytes", figures),
                                _figure(tier, "bandwidth", "bandwidth", figures)))
        tier.done()
    return tuple(tiers)


def _host_memory(node: Node, figures: dict) -> HostMemory | None:
    """``host_memory: {link, capacity: {value, source, confidence}, link_bandwidth: {...}, link_efficiency: {...}}``:
    the bandwidth used is the link's times its efficiency."""
    if not node.has("host_memory"):
        return None
    host = node.child("host_memory")
    memory = HostMemory(host.string("link"), _figure(host, "capacity", "bytes", figures),
                        _figure(host, "link_bandwidth", "bandwidth", figures)
                        * _figure(host, "link_efficiency", None, figures, minimum=0.0, maximum=1.0,
                                  exclusive_minimum=True))
    host.done()
    return memory


def _calibration(node: Node) -> dict:
    """Optional free-form record of a calibration (device, date, torch version, fit, errors)."""
    value = node.raw("calibration", {})
    if not isinstance(value, dict):
        raise node.key_error("calibration", "expected a mapping", value, "a YAML mapping written by llmsim calibrate")
    return value


def load_profile(path: str | Path) -> HardwareProfile:
    """The profile in a YAML file (a copy of its own: a caller changing it changes no other's)."""
    return copy.deepcopy(_parsed_profile(path))


def _parsed_profile(path: str | Path) -> HardwareProfile:
    """The profile in a YAML file, parsed once per content of the file and shared: not to be changed.

    A search builds hundreds of scenario variants, and parsing a profile (0.05-0.2 s) was most of the
    time each took. The cache is keyed by the path as given and the file's text, so an edited file is
    parsed again; the YAML itself is parsed once per text (:func:`profile_data`)."""
    text = read_text(path)               # the front door: size and encoding checked, errors name the file
    key = (str(path), hashlib.sha256(text.encode()).digest())
    profile = _PARSED.get(key)
    if profile is None:
        profile = profile_from_node(Node(_parsed_text(text, str(path)), file=str(path)), path=str(path))
        _keep(_PARSED, key, profile)
    return profile


def profile_data(path: str | Path) -> dict:
    """A profile file's YAML as parsed, shared with every reader of the same text (the profile's own
    figures, a report's appendix and standing): not to be changed. The same file on two search paths (the
    shipped folder and ``$LLMSIM_PROFILE_PATH``) is parsed once."""
    return _parsed_text(read_text(path), str(path))


def _parsed_text(text: str, file: str) -> dict:
    key = hashlib.sha256(text.encode()).digest()
    data = _DATA.get(key)
    if data is None:
        data = parse_yaml(text, file)
        _keep(_DATA, key, data)
    return data


def _keep(cache: dict, key, value) -> None:
    if len(cache) >= PARSED_PROFILES_KEPT:
        del cache[next(iter(cache))]           # the oldest
    cache[key] = value


PARSED_PROFILES_KEPT = 256
_PARSED: dict[tuple, HardwareProfile] = {}     # see _parsed_profile
_DATA: dict[bytes, dict] = {}                  # see profile_data


def profile_dirs() -> list[Path]:
    """Where profiles are looked up: $LLMSIM_PROFILE_PATH (colon-separated), then the shipped ones."""
    extra = [Path(p) for p in os.environ.get("LLMSIM_PROFILE_PATH", "").split(os.pathsep) if p]
    return extra + [shipped_profile_dir()]


def shipped_profile_dir() -> Path:
    """The profiles installed with the package (the repository's hardware_profiles/, see pyproject.toml)."""
    return Path(str(resources.files("llmsim.hardware_profiles")))


def hardware_catalog() -> dict[str, HardwareProfile]:
    """Every profile on the search path, by name (the first found wins)."""
    return {name: copy.deepcopy(profile) for name, profile in _shared_catalog().items()}


def _shared_catalog() -> dict[str, HardwareProfile]:
    catalog: dict[str, HardwareProfile] = {}
    for directory in profile_dirs():
        for path in sorted(directory.glob("*.yaml")):
            profile = _parsed_profile(path)
            catalog.setdefault(profile.name, profile)
    return catalog


def lookup_hardware(name: str, node: Node | None = None, key: str = "hardware", *,
                    copied: bool = True) -> HardwareProfile:
    """A profile by name or file stem (case-insensitive), or by a path to a YAML file; it keeps ``name``
    (``named``). ``copied`` False: the shared parsed profile's figures themselves, for a caller that only reads
    them (a copy is made to be changed)."""
    return replace(_lookup(name, node, key, copied), named=name)


def _lookup(name: str, node: Node | None, key: str, copied: bool) -> HardwareProfile:
    candidate = Path(name)
    if node is not None and not candidate.is_absolute():
        candidate = node.base_dir / candidate
    load = load_profile if copied else _parsed_profile
    if name.endswith((".yaml", ".yml")):
        if not candidate.exists():
            raise _unknown(name, node, key, "file not found")
        return load(candidate)
    for directory in profile_dirs():
        for path in sorted(directory.glob("*.yaml")):
            if path.stem.lower() == name.lower():
                return load(path)
    found = _named(name)
    if found is not None:
        return copy.deepcopy(found) if copied else found
    raise _unknown(name, node, key, "unknown hardware profile", list(_shared_catalog()))


def _named(name: str) -> HardwareProfile | None:
    """The profile of the catalog (:func:`_shared_catalog`: by name, the first found wins) that has ``name``
    (case-insensitive) as its name or one of its aliases, parsing only the files that could hold it.

    A profile's name and aliases are written in its file, so a file whose text does not contain ``name`` is
    not it, and a profile is hidden behind an earlier one of the same name only where that one's text
    contains the name too: looking up an alias parses a few small files, not every profile on the path. (A name
    written with YAML escapes, ``"CS\\x2D3"``, would not be found this way; no profile writes one.)"""
    wanted = name.lower()
    paths = [path for directory in profile_dirs() for path in sorted(directory.glob("*.yaml"))]
    texts = [read_text(path).lower() for path in paths]
    for index, path in enumerate(paths):
        if wanted not in texts[index]:
            continue
        profile = _parsed_profile(path)
        if wanted not in (profile.name.lower(), *(alias.lower() for alias in profile.aliases)):
            continue
        own = profile.name.lower()
        if not any(own in texts[earlier] and _parsed_profile(paths[earlier]).name == profile.name
                   for earlier in range(index)):
            return profile
    return None


def _unknown(name, node, key, message, names=()):
    hint = difflib.get_close_matches(name, list(names), n=1, cutoff=0.4)
    if hint:
        message += f"; did you mean '{hint[0]}'?"
    allowed = ", ".join(names) + " (or a path to a profile YAML)" if names else "a path to a profile YAML"
    if node is not None:
        return node.key_error(key, message, name, allowed)
    return ConfigError(message, key=key, value=name, allowed=allowed)
