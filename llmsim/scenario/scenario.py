"""A scenario: one deployment under one workload, read from YAML and validated once.

Everything downstream (engine, metrics, reports) receives these dataclasses and
never sees YAML. See ``scenarios/`` for annotated examples and docs/reference/scenario.md
(generated from this reader) for every key.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from llmsim.config.reader import Node, NumberRange, load_yaml
from llmsim.catalog.placement import Placement, place, smallest_fitting
from llmsim.catalog.hardware import HardwareProfile, lookup_hardware
from llmsim.catalog.kernel_terms import ENGINE_NAMES, EngineKernels
from llmsim.catalog.models import ModelSpec, lookup_model, model_catalog, model_from_config_json, model_from_node
from llmsim.cost.experts import ExpertParallel, weight_bytes_per_device
from llmsim.errors import ConfigError
from llmsim.config.policies import (Admission, Batching, ControllerKnob, OnTimeout, PreemptionMode, RouterPolicy,
                                   SchedulingPolicy, members_of)
from llmsim.scenario.disaggregation import Disaggregation, Pool, PoolEngine, disaggregation_from_node
from llmsim.scenario.expert_parallel import expert_parallel_from_node
from llmsim.scenario.rollout import RolloutConfig, group_document, group_error, rollout_from_node
from llmsim.scenario.control import (AutoscalingConfig, ControllerConfig, autoscaling_from_node,
                                    controller_from_node)
from llmsim.scenario.vllm import apply_vllm_vocabulary, refuse_unmodelled
from llmsim.speculation.config import SpeculationConfig, resolve_draft_parallelism, speculation_from_node
from llmsim.workload.workload import Workload, workload_from_node

# What an engine-wide queue timeout may do (a traffic class may also have dedicated slots).
ENGINE_ON_TIMEOUT = (OnTimeout.DISPATCH.value, OnTimeout.REJECT.value)
DEFAULT_SEED = 0
COUNT = NumberRange(integer=True, minimum=1, exclusive_minimum=False)     # a count of one or more


@dataclass(frozen=True)
class Deployment:
    replicas: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    router: RouterPolicy = RouterPolicy.LEAST_OUTSTANDING
    load_bound: float = 1.25             # prefix_aware: a replica's outstanding requests stay under this x the mean
    # Routed experts spread over tp x data_parallel GPUs, attention data parallel (None: experts tensor parallel).
    expert_parallel: ExpertParallel | None = None
    # Whether tensor_parallel and pipeline_parallel were ``auto``: placement chose them, and chooses again when
    # a variant changes what they were chosen for (the engine's memory settings).
    auto_layout: tuple[bool, bool] = (False, False)

    def __post_init__(self):
        members_of(self, router=RouterPolicy)

    @property
    def data_parallel(self) -> int:
        """Attention data-parallel ranks of a replica, each with its own requests and KV cache (1 without
        expert parallelism): a replica is one expert-parallel group."""
        return 1 if self.expert_parallel is None else self.expert_parallel.data_parallel(self.tensor_parallel)

    @property
    def devices_per_replica(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel


@dataclass(frozen=True)
class CPUOffload:
    """Idle cached KV blocks move to host memory (see llmsim.sim.prefix_cache)."""
    idle_timeout_s: float = 2.0          # idle this long on the GPU: moved to host memory
    overlap: bool = False                # reloads overlap the admitting iteration's compute (else add to it)
    capacity_bytes: float | None = None  # host memory for KV per device; default: the profile's host_memory


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine's scheduler settings (vLLM names where they exist)."""
    batching: Batching = Batching.CONTINUOUS
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192         # vLLM max_num_batched_tokens
    chunked_prefill: bool = True
    block_size: int = 128                # tokens per KV-cache block
    memory_utilization: float = 0.9      # vLLM gpu_memory_utilization
    runtime_reserve_bytes: float = 2.0 ** 30
    max_model_len: int | None = None     # longest prompt + output accepted; default: the model's context
    queue_timeout_s: float | None = None
    on_timeout: OnTimeout = OnTimeout.DISPATCH
    kv_spill: bool = False               # KV cache in the first outer memory tier instead of the primary
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS      # with traffic classes: llmsim.sim.scheduling
    admission: Admission = Admission.PREEMPT           # see llmsim.sim.engine.ADMISSION_TESTS
    prefix_caching: bool = False         # vLLM enable_prefix_caching: reuse cached blocks of shared prefixes
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE   # vLLM preemption_mode: or swap to host memory
    cpu_offload: CPUOffload | None = None   # a host-memory tier for idle cached blocks
    async_scheduling: bool = False       # vLLM --async-scheduling: the step's CPU work overlaps the previous step
    kernels: EngineKernels = EngineKernels.VLLM   # whose measured kernels price a step (the profile's terms)

    def __post_init__(self):
        members_of(self, batching=Batching, on_timeout=OnTimeout, scheduling_policy=SchedulingPolicy,
                   admission=Admission, preemption_mode=PreemptionMode)

    @property
    def host_tier(self) -> bool:
        """Host memory holds KV blocks: offloaded idle ones or swapped-out ones."""
        return self.cpu_offload is not None or self.preemption_mode is PreemptionMode.SWAP

    @property
    def tiered_kv(self) -> bool:
        """The KV cache does more than count blocks (llmsim.sim.prefix_cache.TieredKV)."""
        return self.prefix_caching or self.host_tier


SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class SLO:
    """Per-request latency limits; a request meets the SLO when every set limit holds.

    A deployment meets its SLO targets when, for each limit set, at least ``percentile``
    percent of the requests are within it (P95 TTFT <= ttft, ...; unfinished and rejected
    requests count as over every limit). ``slo.percentile`` is one number or one per metric.
    """
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    ttft_percentile: float = 95.0
    tpot_percentile: float = 95.0
    e2e_percentile: float = 95.0
    # With traffic classes: (class name, its SLO) for every class, each the top-level limits and
    # percentiles overridden by ``slo.classes.<name>``.
    classes: tuple[tuple[str, SLO], ...] = ()
    # The limits and percentiles the scenario gave (a class's others follow the top-level SLO's).
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def defined(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s)) or \
            any(slo.defined for _, slo in self.classes)

    def for_class(self, name: str) -> SLO:
        """The SLO of traffic class ``name`` (the top-level one when it has none of its own)."""
        return dict(self.classes).get(name, self)

    def targets(self) -> dict[str, tuple[float, float]]:
        """metric -> (limit in seconds, percentile) for every limit set."""
        return {m: (getattr(self, f"{m}_s"), getattr(self, f"{m}_percentile")) for m in SLO_METRICS
                if getattr(self, f"{m}_s") is not None}


@dataclass(frozen=True)
class PlanConfig:
    """``plan``: what ``llmsim plan`` compares, read by no other command."""
    # Chips to plan for when ``--hardware`` is not given, by profile name or file path as written (a path is
    # relative to the scenario); () plans for the scenario's own.
    hardware: tuple[str, ...] = ()


@dataclass(frozen=True)
class SimulationConfig:
    warmup_s: float | None = None        # default: 10% of the arrival window
    horizon_s: float | None = None       # default: llmsim.sim.horizon.default_horizon_s


# The defaults a YAML file gets for what it leaves out: the dataclasses' own.
DEPLOYMENT, ENGINE, SLO_DEFAULTS, SIMULATION = Deployment(), EngineConfig(), SLO(), SimulationConfig()
PLAN = PlanConfig()


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    model: ModelSpec
    hardware: HardwareProfile
    deployment: Deployment
    engine: EngineConfig
    workload: Workload
    slo: SLO
    simulation: SimulationConfig
    path: str | None = None
    speculation: SpeculationConfig | None = None     # None, or a static k of 0: plain decoding
    controller: ControllerConfig | None = None       # adaptive control of an engine knob (default: none)
    autoscaling: AutoscalingConfig | None = None     # replicas added and removed with the load (default: none)
    rollout: RolloutConfig | None = None             # canary and shadow groups beside this deployment (default: none)
    # The folder the scenario's relative paths (traces, chip profiles, acceptance files) start from.
    source_dir: str | None = field(default=None, repr=False, compare=False)
    # vLLM flags of engine.vllm_args (or --vllm-args) that llmsim does not model, each with why.
    vllm_notes: tuple[str, ...] = field(default=(), compare=False)
    # Prefill and decode on pools of their own (deployment.disaggregation); None: aggregated.
    disaggregation: Disaggregation | None = None
    plan: PlanConfig = PLAN                          # read by llmsim plan only

    @property
    def speculating(self) -> bool:
        return self.speculation is not None and self.speculation.enabled

    @property
    def memory(self) -> Placement:
        """Where weights and KV cache live on each replica's devices.

        A colocated draft shares the devices (weights and its KV per token); a draft on
        devices of its own caps the replica's KV cache at what those devices hold.
        """
        spec = self.speculation if self.speculating else None
        draft = spec.colocated_draft if spec else None
        engine, dep = self.engine, self.deployment
        weights = (None if dep.expert_parallel is None else
                   weight_bytes_per_device(self.model, dep.tensor_parallel, dep.pipeline_parallel, dep.expert_parallel))
        draft_tp = 1
        if spec and draft:
            # Reading the scenario resolves a colocated draft's parallelism (resolve_draft_parallelism).
            assert spec.draft_tensor_parallel is not None
            draft_tp = spec.draft_tensor_parallel
        placement = place(self.model, self.hardware, dep.tensor_parallel,
                          dep.pipeline_parallel, engine.memory_utilization,
                          engine.block_size, engine.max_batch_tokens, engine.runtime_reserve_bytes, engine.kv_spill,
                          draft, draft_tp, weights)
        if spec and spec.extra_devices:
            draft_placement = self.draft_memory
            placement = replace(placement, num_blocks=min(placement.num_blocks, draft_placement.num_blocks))
        return placement

    @property
    def draft_memory(self) -> Placement:
        """The draft's own devices (``placement: separate``), holding its weights and KV cache."""
        spec, engine = self.speculation, self.engine
        assert spec is not None and spec.draft is not None     # asked only of a draft placed separately
        # A draft iteration handles at most one token per running sequence.
        return place(spec.draft, self.hardware, spec.draft_devices, 1, engine.memory_utilization,
                     engine.block_size, engine.max_num_seqs, engine.runtime_reserve_bytes)

    @property
    def devices_per_replica(self) -> int:
        """Devices one replica occupies, a separately placed draft's included."""
        spec = self.speculation
        extra = spec.extra_devices if spec is not None and spec.enabled else 0
        return self.deployment.devices_per_replica + extra

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len or self.model.max_context

    def with_seed(self, seed: int) -> Scenario:
        return replace(self, seed=seed)

    def pool(self, name: str) -> Scenario:
        """This scenario as one pool of its disaggregated deployment (``prefill`` or ``decode``) would
        run on its own: the pool's chip, replicas and parallelism, aggregated."""
        pool: Pool = getattr(self.disaggregation, name)
        return replace(self, hardware=pool.hardware, disaggregation=None,
                       engine=replace(self.engine, **pool.engine.settings()),
                       deployment=replace(self.deployment, replicas=pool.replicas,
                                          tensor_parallel=pool.tensor_parallel,
                                          pipeline_parallel=pool.pipeline_parallel,
                                          expert_parallel=pool.expert_parallel))

    def plain_decoding(self) -> Scenario:
        """This scenario without speculation: a controller that moves the draft length goes with it
        (plain decoding has no draft length to move)."""
        controller = self.controller
        if controller is not None and controller.knob is ControllerKnob.SPECULATION_K:
            controller = None
        return replace(self, speculation=None, controller=controller)


def load_scenario(path: str | Path, seed: int | None = None, vllm_args: str | None = None) -> Scenario:
    """Read and validate a scenario YAML file; errors are ConfigErrors naming file, key and value.

    ``vllm_args`` (``--vllm-args``): vLLM serve flags applied after the file's own settings, which they
    override."""
    scenario = scenario_from_node(Node(load_yaml(path), file=str(path)), vllm_args)
    scenario = replace(scenario, path=str(path))
    return scenario if seed is None else scenario.with_seed(seed)


def simulation_from_node(sim: Node, defaults: SimulationConfig = SIMULATION) -> SimulationConfig:
    """``simulation``: its keys read, ``defaults`` for those it leaves out."""
    return SimulationConfig(warmup_s=sim.quantity("warmup", "duration", defaults.warmup_s, minimum=0.0,
                                                  exclusive_minimum=False),
                            horizon_s=sim.quantity("horizon", "duration", defaults.horizon_s))


def read_replicas(dep: Node, default: int = DEPLOYMENT.replicas) -> int:
    """``deployment.replicas``: a whole number of replicas, at least one."""
    return dep.number("replicas", default, **COUNT)


def plan_from_node(node: Node, defaults: PlanConfig = PLAN) -> PlanConfig:
    """``plan: {hardware: [names or profile files]}``, each chip looked up as ``hardware`` is."""
    listed = node.raw("hardware", None)
    node.done()
    if listed is None:
        return defaults
    if not isinstance(listed, list) or not listed or not all(isinstance(name, str) for name in listed):
        raise node.key_error("hardware", "expected a list of hardware profile names", listed,
                             "e.g. [H100-SXM, CS-3]")
    for name in listed:
        lookup_hardware(name, node, "hardware")      # an unknown name is a ConfigError listing the profiles
    return replace(defaults, hardware=tuple(listed))


def read_seed(root: Node) -> int:
    """A scenario's ``seed`` (DEFAULT_SEED when absent); sweeps and ``--seeds`` read it alone from
    files whose other keys are not validated yet."""
    return root.number("seed", DEFAULT_SEED, integer=True, minimum=0, exclusive_minimum=False)


def engine_hardware(eng: Node, engine: EngineConfig, hardware: HardwareProfile) -> HardwareProfile:
    """The profile priced by the engine's kernels: another engine than the default needs terms of its own."""
    if engine.kernels is ENGINE.kernels or hardware.kernels is None:
        return hardware
    if engine.kernels.value not in hardware.engine_kernels:
        raise eng.key_error("kernels", f"{hardware.name} has no measured kernel terms for this engine",
                            engine.kernels.value, ", ".join([ENGINE.kernels.value, *hardware.engine_kernels]))
    return hardware.for_engine(engine.kernels)


def scenario_from_node(root: Node, vllm_args: str | None = None) -> Scenario:
    vllm_notes = apply_vllm_vocabulary(root, vllm_args)
    name = root.string("name", Path(root.file).stem if root.file else "scenario")
    seed = read_seed(root)
    model = read_model(root)
    # The shared parsed profile, not a copy of it: a Scenario is frozen and only reads its chip, and copying
    # a profile with its kernel terms was most of the time a search's variant took to read again.
    hardware = lookup_hardware(root.string("hardware"), root, "hardware", copied=False)

    dep = root.child("deployment")
    replicas = read_replicas(dep)
    tp, pp = read_parallelism(dep, model)
    router = RouterPolicy(dep.choice("router", RouterPolicy.names(), DEPLOYMENT.router))
    load_bound = dep.number("load_bound", DEPLOYMENT.load_bound, minimum=1.0)
    experts_node = dep.child("expert_parallel") if dep.has("expert_parallel") else None

    eng = root.child("engine")
    engine = EngineConfig(
        batching=Batching(eng.choice("batching", Batching.names(), ENGINE.batching)),
        max_num_seqs=eng.number("max_num_seqs", ENGINE.max_num_seqs, **COUNT),
        max_batch_tokens=eng.number("max_batch_tokens", ENGINE.max_batch_tokens, **COUNT),
        chunked_prefill=eng.boolean("chunked_prefill", ENGINE.chunked_prefill),
        block_size=eng.number("block_size", ENGINE.block_size, **COUNT),
        memory_utilization=eng.number("memory_utilization", ENGINE.memory_utilization, minimum=0.0, maximum=1.0),
        runtime_reserve_bytes=eng.quantity("runtime_reserve", "bytes", ENGINE.runtime_reserve_bytes, minimum=0.0,
                                           exclusive_minimum=False),
        max_model_len=eng.number("max_model_len", ENGINE.max_model_len, **COUNT),
        queue_timeout_s=eng.quantity("queue_timeout", "duration", ENGINE.queue_timeout_s),
        on_timeout=OnTimeout(eng.choice("on_timeout", ENGINE_ON_TIMEOUT, ENGINE.on_timeout)),
        kv_spill=eng.boolean("kv_spill", ENGINE.kv_spill),
        scheduling_policy=SchedulingPolicy(eng.choice("scheduling_policy", SchedulingPolicy.names(),
                                                      ENGINE.scheduling_policy)),
        admission=Admission(eng.choice("admission", Admission.names(), ENGINE.admission)),
        prefix_caching=eng.boolean("prefix_caching", ENGINE.prefix_caching),
        preemption_mode=PreemptionMode(eng.choice("preemption_mode", PreemptionMode.names(),
                                                  ENGINE.preemption_mode)),
        cpu_offload=read_cpu_offload(eng),
        async_scheduling=eng.boolean("async_scheduling", ENGINE.async_scheduling),
        kernels=EngineKernels(eng.choice("kernels", ENGINE_NAMES, ENGINE.kernels.value)))
    hardware = engine_hardware(eng, engine, hardware)
    experts = None if experts_node is None else expert_parallel_from_node(experts_node, model, tp, pp, hardware,
                                                                           engine.kernels.value)
    check_kv_tiers(eng, engine, hardware)
    if router is RouterPolicy.PREFIX_AWARE and not engine.prefix_caching:
        raise dep.key_error("router", "routes by the prefix cache's contents, which needs prefix caching", router,
                            "engine.prefix_caching: true, or another router: " + ", ".join(RouterPolicy.names()[:3]))
    disaggregation = None
    if dep.raw("disaggregation", None) is not None:       # null: aggregated (a plan's override says so)
        disaggregation = disaggregation_from_node(
            dep.child("disaggregation"),
            lambda pool, key: (engine_hardware(eng, engine, lookup_hardware(pool.string(key), pool, key, copied=False))
                               if pool.has(key) else hardware),
            model, PoolEngine.shared_by(engine), engine.kernels.value)
        if router is RouterPolicy.SHARED_QUEUE:
            raise dep.key_error("router", "a disaggregated deployment routes each request to one replica of each "
                                "pool", router, ", ".join(r for r in RouterPolicy.names() if r != router))
    dep.done()
    check_kv_spill(eng, engine, hardware)
    check_batch_tokens(eng, engine)
    refuse_unmodelled(eng)
    eng.done()

    speculation = None
    if root.has("speculation"):
        speculation = speculation_from_node(root.child("speculation"), model, read_model, tp, pp, engine.batching)
    workload = workload_from_node(root.child("workload"), max_tokens=engine.max_model_len or model.max_context)
    if engine.prefix_caching:
        check_hash_ids(root, engine, workload)
    check_classes(root, engine, workload)
    controller = None
    if root.has("controller"):
        if engine.batching is not Batching.CONTINUOUS:
            raise root.key_error("controller", "the controller adjusts a continuous-batching engine",
                                 root.raw("controller"), "engine.batching: continuous")
        controller = controller_from_node(root.child("controller"), engine, speculation)
    autoscaling = None
    if root.has("autoscaling"):
        autoscaling = autoscaling_from_node(root.child("autoscaling"), replicas, router)
    rollout = _rollout(root, autoscaling)
    if experts is not None:
        for key, config in (("autoscaling", autoscaling), ("rollout", rollout)):
            if config is not None:
                raise root.key_error(key, "is not modelled with expert parallelism (a replica is a whole "
                                     "expert-parallel group)", root.raw(key), "no deployment.expert_parallel")
    slo_node = root.child("slo")
    slo = _slo(slo_node, SLO_DEFAULTS)
    if slo_node.has("classes"):
        slo = replace(slo, classes=_class_slos(slo_node, slo, workload.class_names))
    slo_node.done()
    sim = root.child("simulation")
    simulation = simulation_from_node(sim)
    sim.done()
    plan = plan_from_node(root.child("plan"))
    root.done()
    deployment = replace(resolve_parallelism(root, model, hardware, engine, replicas, tp, pp, router, speculation),
                         load_bound=load_bound, expert_parallel=experts)
    if speculation is not None:
        speculation = resolve_draft_parallelism(speculation, deployment.tensor_parallel)
    scenario = Scenario(name, seed, model, hardware, deployment, engine, workload, slo, simulation,
                        speculation=speculation, controller=controller, autoscaling=autoscaling, rollout=rollout,
                        source_dir=str(root.base_dir), vllm_notes=vllm_notes,
                        disaggregation=disaggregation, plan=plan)
    check_fits(scenario, root)
    for group in rollout.groups if rollout is not None else ():
        try:                                # each group's settings are checked with the scenario's
            scenario_from_node(Node(group_document(root.data, group), file=root.file, base_dir=root.base_dir))
        except ConfigError as error:
            raise group_error(group, error) from None
    return scenario


def _rollout(root: Node, autoscaling) -> RolloutConfig | None:
    if not root.has("rollout"):
        return None
    if autoscaling is not None:
        raise root.key_error("rollout", "a rollout's groups keep fixed replica counts: not modelled with autoscaling",
                             root.raw("rollout"), "rollout or autoscaling, not both")
    return rollout_from_node(root.child("rollout"))


def read_cpu_offload(eng: Node, default: CPUOffload = CPUOffload()) -> CPUOffload | None:
    """``engine.cpu_offload``: false/absent (none), true (defaults) or ``{idle_timeout, overlap, capacity}``
    (``default`` for the keys it leaves out)."""
    raw = eng.raw("cpu_offload", False)
    if isinstance(raw, bool):
        return CPUOffload() if eng.boolean("cpu_offload", False) else None
    node = eng.child("cpu_offload")
    offload = CPUOffload(
        idle_timeout_s=node.quantity("idle_timeout", "duration", default.idle_timeout_s, minimum=0.0,
                                     exclusive_minimum=False),
        overlap=node.boolean("overlap", default.overlap),
        capacity_bytes=node.quantity("capacity", "bytes", default.capacity_bytes))
    node.done()
    return offload


def check_kv_tiers(eng: Node, engine: EngineConfig, hardware: HardwareProfile) -> None:
    """Prefix caching, offload and swap need continuous batching; a host tier needs host memory."""
    if engine.batching is Batching.STATIC and engine.tiered_kv:
        key = ("prefix_caching" if engine.prefix_caching else
               "cpu_offload" if engine.cpu_offload is not None else "preemption_mode")
        raise eng.key_error(key, "static batching holds each batch's KV to the end: no prefix cache, "
                                 "offload or swap", eng.raw(key), "batching: continuous, or leave this out")
    if engine.cpu_offload is not None and not engine.prefix_caching:
        raise eng.key_error("cpu_offload", "offloading moves idle cached blocks, which exist only with prefix "
                                           "caching", eng.raw("cpu_offload"), "prefix_caching: true, or no cpu_offload")
    if engine.host_tier and hardware.host_memory is None:
        key = "cpu_offload" if engine.cpu_offload is not None else "preemption_mode"
        raise eng.key_error(key, f"{hardware.name} has no host_memory (capacity and link) in its profile",
                            eng.raw(key), "a profile with host_memory, or leave this out")


def check_hash_ids(root: Node, engine: EngineConfig, workload: Workload) -> None:
    """A replayed trace's ``hash_ids`` (one per ``hash_block_tokens`` prompt tokens) are the prefix
    cache's block identities: the engine's blocks must tile them, and each request needs one per block."""
    trace = workload.trace
    if trace is None or trace.hash_ids is None:
        return
    hash_block = workload.hash_block_tokens
    if hash_block % engine.block_size:
        raise root.child("engine").key_error(
            "block_size", f"does not divide the trace's hash block of {hash_block} tokens "
                          "(workload.arrival.hash_block_tokens), so its hash_ids cannot name the engine's blocks",
            engine.block_size, "a divisor of " + str(hash_block) + ": " + _divisors(hash_block))
    for i, (hashes, prompt) in enumerate(zip(trace.hash_ids, trace.prompt_tokens.tolist())):
        if len(hashes) != -(-prompt // hash_block):
            raise root.child("workload").child("arrival").key_error(
                "path", f"request {i + 1} of the trace has {len(hashes)} hash_ids for {prompt} prompt tokens",
                list(hashes)[:8], f"one hash id per {hash_block} prompt tokens ({-(-prompt // hash_block)} here), "
                                  "or set workload.arrival.hash_block_tokens")


def _slo(node: Node, defaults: SLO) -> SLO:
    """An SLO's limits and percentiles (``slo``, or ``slo.classes.<name>`` over the top-level ``defaults``)."""
    limits = {f"{key}_s": node.quantity(key, "duration", getattr(defaults, f"{key}_s")) for key in SLO_METRICS}
    percentile = node.data.get("percentile")
    given = {metric for metric in SLO_METRICS if node.has(metric)} | {
        f"{metric}_percentile" for metric in SLO_METRICS
        if percentile is not None and (not isinstance(percentile, dict) or metric in percentile)}
    return SLO(**limits, **_slo_percentiles(node, defaults, limits), given=frozenset(given))


def _slo_percentiles(node: Node, defaults: SLO, limits: dict) -> dict:
    """``slo.percentile``: one percentile for every limit (default 95), or ``{ttft: 99, tpot: 95}``."""
    bounds = NumberRange(minimum=0.0, maximum=100.0, exclusive_minimum=True)
    if not isinstance(node.raw("percentile", None), dict):
        if not node.has("percentile"):
            return {f"{m}_percentile": getattr(defaults, f"{m}_percentile") for m in SLO_METRICS}
        value = node.number("percentile", **bounds)
        return {f"{m}_percentile": float(value) for m in SLO_METRICS}
    each = node.child("percentile")
    values = {}
    for metric in SLO_METRICS:
        if each.has(metric) and limits[f"{metric}_s"] is None:
            raise each.key_error(metric, f"a percentile for {metric} needs a limit ({node.key_path(metric)})",
                                 each.raw(metric), f"set {node.key_path(metric)}, or drop this key")
        values[f"{metric}_percentile"] = float(each.number(metric, getattr(defaults, f"{metric}_percentile"),
                                                           **bounds))
    each.done()
    return values


def _class_slos(node: Node, top: SLO, names: tuple[str, ...]) -> tuple[tuple[str, SLO], ...]:
    """``slo.classes``: each traffic class's own limits and percentiles over the top-level ones."""
    raw = node.raw("classes")
    if not isinstance(raw, dict):
        raise node.key_error("classes", "expected a mapping of class names to SLOs", raw,
                             "e.g. {interactive: {ttft: 200 ms}}")
    holder = node.child("classes")
    for name in raw:
        if str(name) not in names:
            raise holder.key_error(str(name), "no traffic class of this name (workload.classes)", raw[name],
                                   ", ".join(names) if names else "no classes: set workload.classes first")
    out = []
    for name in names:
        each = holder.child(name, {})
        out.append((name, _slo(each, top)))
        each.done()
    return tuple(out)


def check_kv_spill(eng: Node, engine: EngineConfig, hardware: HardwareProfile) -> None:
    """KV spilled to an outer memory tier needs a profile with one."""
    if engine.kv_spill and not hardware.outer_tiers:
        raise eng.key_error("kv_spill", f"{hardware.name} has no outer memory tier to spill to", True,
                            "false, or a profile with outer_memory")


def check_batch_tokens(eng: Node, engine: EngineConfig) -> None:
    """A batch's token budget holds one token of every running sequence."""
    if engine.max_batch_tokens < engine.max_num_seqs:
        raise eng.key_error("max_batch_tokens", f"must be at least max_num_seqs ({engine.max_num_seqs}), "
                            "or some running sequences could never decode", engine.max_batch_tokens,
                            f"an integer >= {engine.max_num_seqs}")


def check_classes(root: Node, engine: EngineConfig, workload: Workload) -> None:
    """Traffic classes need continuous batching, and a policy other than FCFS needs classes."""
    eng = root.child("engine")
    if engine.scheduling_policy is not SchedulingPolicy.FCFS and not workload.classes:
        raise eng.key_error("scheduling_policy", "orders traffic classes, and the workload has none",
                            engine.scheduling_policy, "fcfs, or set workload.classes")
    if workload.classes and engine.batching is not Batching.CONTINUOUS:
        raise root.child("workload").key_error("classes", "traffic classes need continuous batching",
                                               workload.class_names, "engine.batching: continuous")
    reserved = sum(c.reserved_seqs for c in workload.classes)
    if reserved > engine.max_num_seqs:
        raise root.child("workload").key_error(
            "classes", f"the classes reserve {reserved} sequence slots, more than engine.max_num_seqs "
                       f"({engine.max_num_seqs})", {c.name: c.reserved_seqs for c in workload.classes},
            f"reserved_seqs summing to at most {engine.max_num_seqs}")


def read_parallelism(dep: Node, model: ModelSpec, defaults: tuple[int | None, int | None] | None = None
                     ) -> tuple[int | None, int | None]:
    """``deployment.tensor_parallel`` and ``pipeline_parallel`` (None: ``auto``, placement decides; ``defaults``
    for a key left out, else the reader's): tensor parallelism divides the heads, stages are at most the layers."""
    tp, pp = (_parallel(dep, key) if defaults is None or dep.has(key) else default
              for key, default in zip(("tensor_parallel", "pipeline_parallel"), defaults or (None, None)))
    if tp is not None and model.num_heads % tp:
        raise dep.key_error("tensor_parallel", f"must divide the model's {model.num_heads} attention heads",
                            tp, _divisors(model.num_heads) + " or auto")
    if pp is not None and pp > model.num_layers:
        raise dep.key_error("pipeline_parallel", f"cannot exceed the model's {model.num_layers} layers",
                            pp, f"1..{model.num_layers} or auto")
    return tp, pp


def check_fits(scenario: Scenario, root: Node) -> None:
    """A scenario's devices must hold its model, a draft placed separately, one longest request's KV cache
    and a host tier's block; a disaggregated deployment's pools likewise (ConfigErrors naming the key)."""
    _check_fits(scenario, root)
    if scenario.disaggregation is not None:
        _check_disaggregation(scenario, root)


def _parallel(node: Node, key: str) -> int | None:
    """An explicit degree of parallelism, or None for ``auto`` (placement decides)."""
    default = getattr(DEPLOYMENT, key)
    if node.raw(key, default) == "auto":
        return None
    return node.number(key, default, integer=True, minimum=1, exclusive_minimum=False)


def resolve_parallelism(root: Node, model: ModelSpec, hardware: HardwareProfile, engine: EngineConfig, replicas: int,
                        tp: int | None, pp: int | None, router: RouterPolicy,
                        speculation: SpeculationConfig | None) -> Deployment:
    """The deployment's layout: ``tp`` and ``pp`` as given, placement choosing those that are None (``auto``):
    the smallest that holds the model and one longest request's KV cache."""
    if tp is not None and pp is not None:
        return Deployment(replicas, tp, pp, router)
    auto = (tp is None, pp is None)
    longest = engine.max_model_len or model.max_context
    spec = speculation if speculation is not None and speculation.enabled else None
    draft = spec.colocated_draft if spec else None
    if spec and pp is None:
        pp = 1                          # speculative decoding is modelled without pipeline stages
    fitting = smallest_fitting(model, hardware, engine.memory_utilization, engine.block_size,
                               engine.max_batch_tokens, engine.runtime_reserve_bytes, tp, pp, engine.kv_spill,
                               min_kv_tokens=longest, draft=draft,
                               draft_tensor_parallel=spec.draft_tensor_parallel if spec and draft else None)
    if fitting is None:
        raise root.error(f"{model.name} does not fit, with KV room for one {longest:,}-token request "
                         f"(engine.max_model_len), in the {hardware.memory_name} of any number of "
                         f"{hardware.name} devices with this parallelism",
                         key="deployment", value={"tensor_parallel": tp or "auto", "pipeline_parallel": pp or "auto"},
                         allowed="auto for both, a smaller weight_dtype, or a larger device")
    return Deployment(replicas, fitting.tensor_parallel, fitting.pipeline_parallel, router, auto_layout=auto)


def read_model(root: Node, key: str = "model") -> ModelSpec:
    """A model (``model:``, ``speculation.draft:``) is a catalog name, a path to a config.json or
    a model YAML, or inline fields."""
    raw = root.raw(key)
    if isinstance(raw, str) and raw.endswith(".json"):
        return model_from_config_json(root.path_value(key))
    if isinstance(raw, str) and raw.endswith((".yaml", ".yml")):
        path = root.path_value(key)
        return model_from_node(Node(load_yaml(path), file=str(path)))
    if isinstance(raw, str):
        return lookup_model(raw, model_catalog(), root, key)
    return model_from_node(root.child(key))


def _check_fits(scenario: Scenario, root: Node) -> None:
    spec = scenario.speculation if scenario.speculating else None
    if spec and spec.extra_devices and not scenario.draft_memory.fits:
        assert spec.draft is not None           # extra devices: a draft model placed separately
        draft_placement = scenario.draft_memory
        raise root.error(f"the draft {spec.draft.name} does not fit on {spec.draft_devices} x "
                         f"{scenario.hardware.name}: {draft_placement.weights_per_device_bytes / 1e9:.1f} GB of "
                         f"weights per device, {draft_placement.usable_per_device_bytes / 1e9:.1f} GB usable",
                         key="speculation.draft_devices", value=spec.draft_devices,
                         allowed="more draft devices, or a smaller draft weight_dtype")
    placement = scenario.memory
    if placement.fits:
        _check_holds_longest(scenario, placement, root)
        _check_host_tier(scenario, placement, root)
        return
    gb = 1e9
    dep = scenario.deployment
    if dep.expert_parallel is not None:
        ep = dep.expert_parallel
        raise root.error(f"{scenario.model.name} does not fit on an expert-parallel group of {ep.degree} x "
                         f"{scenario.hardware.name} (tp {dep.tensor_parallel} x pp {dep.pipeline_parallel}): "
                         f"{placement.weights_per_device_bytes / gb:.1f} GB of weights "
                         f"({ep.experts_per_rank(scenario.model)} experts per GPU) and "
                         f"{placement.activation_reserve_per_device_bytes / gb:.1f} GB of activations per GPU, but "
                         f"only {placement.usable_per_device_bytes / gb:.1f} GB usable, leaving no room for one "
                         "KV block",
                         key="deployment.expert_parallel.degree", value=ep.degree,
                         allowed="a larger degree (fewer experts per GPU), more pipeline stages, fewer redundant "
                                 "experts, or a larger device")
    message = (f"{scenario.model.name} does not fit on {dep.devices_per_replica} x {scenario.hardware.name}: "
               f"{placement.weights_per_device_bytes / gb:.1f} GB of weights and "
               f"{placement.activation_reserve_per_device_bytes / gb:.1f} GB of activations per device, "
               f"but only {placement.usable_per_device_bytes / gb:.1f} GB usable "
               f"({scenario.engine.memory_utilization:g} of {placement.capacity_per_device_bytes / gb:.0f} GB), "
               f"leaving no room for one KV block")
    allowed = "a smaller weight_dtype, or a larger device"
    engine = scenario.engine
    draft = spec.colocated_draft if spec else None
    if draft is not None:
        message += f" (with the colocated draft {draft.name})"
    fitting = smallest_fitting(scenario.model, scenario.hardware, engine.memory_utilization, engine.block_size,
                               engine.max_batch_tokens, engine.runtime_reserve_bytes,
                               pipeline_parallel=dep.pipeline_parallel, kv_spill=engine.kv_spill, draft=draft)
    if fitting:
        allowed = (f"tensor_parallel: {fitting.tensor_parallel} (the fewest devices that fit, dividing the heads), "
                   + allowed)
    raise root.error(message, key="deployment.tensor_parallel", value=dep.tensor_parallel, allowed=allowed)


def _check_disaggregation(scenario: Scenario, root: Node) -> None:
    """Each pool must hold the model and one max_model_len request's KV; what the disaggregated simulation
    does not model with it is refused."""
    where = "deployment.disaggregation"
    for what, unmodelled in (("speculation", scenario.speculating), ("controller", scenario.controller),
                             ("autoscaling", scenario.autoscaling), ("rollout", scenario.rollout),
                             ("workload.classes", scenario.workload.classes)):
        if unmodelled:
            raise root.error(f"{where} is not modelled together with {what}", key=what,
                             value=root.raw(what) if "." not in what else "set",
                             allowed=f"leave out {what}, or {where}")
    if scenario.engine.batching is not Batching.CONTINUOUS:
        raise root.error(f"{where} needs continuous batching", key="engine.batching",
                         value=scenario.engine.batching, allowed="continuous")
    # A transferred prompt's last token is continued as a chunk (a decode pool's own false is refused as read).
    if not scenario.pool("decode").engine.chunked_prefill:
        raise root.error(f"{where}: the decode pool is modelled with chunked prefill (vLLM V1's scheduler)",
                         key="engine.chunked_prefill", value=False,
                         allowed=f"true, or {where}.decode.engine.chunked_prefill: true")
    for name in ("prefill", "decode"):
        pool = scenario.pool(name)
        dep, placement = pool.deployment, pool.memory
        experts = dep.expert_parallel
        # What to change: the pool's expert-parallel degree where it has one, else its tensor parallelism.
        key, value = ((f"{where}.{name}.expert_parallel.degree", experts.degree) if experts is not None else
                      (f"{where}.{name}.tensor_parallel", dep.tensor_parallel))
        more = "a larger expert-parallel degree (fewer experts per GPU)" if experts is not None else \
            "more tensor_parallel or pipeline_parallel"
        if not placement.fits:
            shape = (f"an expert-parallel group of {experts.degree} x {pool.hardware.name} "
                     f"({experts.experts_per_rank(scenario.model)} experts per GPU)" if experts is not None else
                     f"{dep.devices_per_replica} x {pool.hardware.name}")
            raise root.error(f"{scenario.model.name} does not fit on {shape} (the {name} pool): "
                             f"{placement.weights_per_device_bytes / 1e9:.1f} GB of weights per device, "
                             f"{placement.usable_per_device_bytes / 1e9:.1f} GB usable", key=key, value=value,
                             allowed=f"{more}, a smaller weight_dtype, or a larger device")
        if placement.kv_capacity_tokens < scenario.max_model_len:
            raise root.error(f"the {name} pool's KV cache holds {placement.kv_capacity_tokens:,} tokens per replica, "
                             f"less than one request of max_model_len {scenario.max_model_len:,} tokens",
                             key=key, value=value,
                             allowed=f"more KV room ({more}), or a smaller engine.max_model_len")


def _check_holds_longest(scenario: Scenario, placement: Placement, root: Node) -> None:
    """The KV cache must hold one request of ``max_model_len`` tokens, or the engine rejects every
    request longer than the cache at run time."""
    capacity, longest = placement.kv_capacity_tokens, scenario.max_model_len
    if capacity >= longest:
        return
    where = "engine.max_model_len" if scenario.engine.max_model_len else f"the model's context, {longest:,} tokens"
    raise root.error(f"the KV cache holds {capacity:,} tokens per replica ({placement.num_blocks:,} blocks of "
                     f"{placement.block_size}), less than one request of max_model_len {longest:,} tokens "
                     f"({where}): requests longer than the cache would all be rejected",
                     key="engine.max_model_len", value=longest,
                     allowed=f"max_model_len <= {capacity:,}, or more KV room: a higher engine.memory_utilization, "
                             "more tensor_parallel, a smaller weight_dtype or a larger device")


def host_kv_blocks(scenario: Scenario, placement: Placement) -> int:
    """KV blocks the host tier holds per replica: host memory per device over a block's bytes per device."""
    offload = scenario.engine.cpu_offload
    capacity = offload.capacity_bytes if offload is not None and offload.capacity_bytes is not None else None
    if capacity is None:
        host = scenario.hardware.host_memory
        assert host is not None                 # a host tier needs the profile's host memory (check_kv_tiers)
        capacity = host.capacity_bytes
    return int(capacity // (placement.kv_bytes_per_token_per_device * placement.block_size))


def _check_host_tier(scenario: Scenario, placement: Placement, root: Node) -> None:
    """A host tier must hold at least one KV block."""
    engine = scenario.engine
    if not engine.host_tier or host_kv_blocks(scenario, placement) >= 1:
        return
    block_bytes = placement.kv_bytes_per_token_per_device * placement.block_size
    offload = engine.cpu_offload
    if offload is not None and offload.capacity_bytes is not None:
        key, value = "engine.cpu_offload.capacity", root.child("engine").child("cpu_offload").raw("capacity")
    else:
        key, value = "hardware", f"{scenario.hardware.name} host_memory.capacity"
    raise root.error(f"the host-memory tier holds less than one KV block ({block_bytes / 1e6:.3g} MB per device: "
                     f"{placement.block_size} tokens of {scenario.model.name})", key=key, value=value,
                     allowed=f"at least {block_bytes / 1e6:.3g} MB per device")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
