"""The resource guard: a run's memory and event count, estimated from the scenario before it runs.

A scenario can ask for more than a machine holds (``num_requests: 1e9``, ``replicas: 100000``)
with a few characters, and the simulator would find out only when an allocation fails, minutes
or hours later. :func:`check_run_size` estimates the run first, from the scenario alone (no
trace is drawn), and refuses one whose estimate is above :data:`MAX_RUN_MEMORY_BYTES`,
:data:`MAX_RUN_EVENTS` or :data:`MAX_RUN_ENGINES` with a ConfigError that gives the estimate
and the override (``--force`` on the command line, ``force=True`` in Python).

The estimate:

- requests: ``num_requests``, or the expected arrivals in ``duration`` (rate x duration, plus
  six standard deviations of a Poisson count), or the trace's rows; their mean prompt and output
  lengths six standard errors above the distributions' means;
- engine iterations: at most one per output token and prefill chunk of every request (exact for
  a lightly loaded engine, which runs batches of one), and at most twice what a fluid view of the
  engine gives (:func:`_fluid_iterations`: Little's law for the mean batch, plus the longest
  output decoded alone at the end);
- memory: per request, per iteration (the iteration log) and per engine, at sizes measured as
  peak RSS on Llama-3.1-8B / H100 runs (20,000 and 60,000 requests at 12/s: 130 and 388 MB for
  235,000 and 694,000 iterations, about 0.5 kB per iteration with its request's share; 20,000
  replicas: 37 kB each), rounded up; a run streamed to disk (``streamed``) keeps neither records nor
  the iteration log, and costs a fifth of that per request and per iteration.

An engine also counts as :data:`EVENTS_PER_ENGINE` events: 20,000 replicas took 56 s to build and
report on 4,000 requests, about 2.8 ms each, the time of ~100 iterations. Every replica an
autoscaler may start (``max_replicas``) and every rollout group's replicas are built. The estimate
runs two to three times the measured peak; the limits are set with that in mind.

Work that does not grow with the requests counts too: the controller and the autoscaler wake
every ``interval`` until the horizon (one event and one log row each), and a time-varying arrival
rate is integrated on knots whose number grows with the window over its ``period`` (diurnal) or
its states' mean durations (MMPP). A refusal names the key behind the largest share of what is
over the limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from llmsim.config.limits import MAX_RUN_ENGINES, MAX_RUN_EVENTS, MAX_RUN_MEMORY_BYTES
from llmsim.errors import ConfigError
from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.sim.horizon import default_horizon_s
from llmsim.scenario.rollout_groups import group_scenarios
from llmsim.scenario.scenario import Scenario
from llmsim.workload.profiles import RateProfile
from llmsim.workload.trace import Trace


BYTES_PER_REQUEST = 3_000
BYTES_PER_ITERATION = 600
# A run streamed to disk (llmsim run above llmsim.analysis.streaming.STREAM_ABOVE_REQUESTS requests) keeps
# no records or iteration log: 1,000,000 chat requests (about 3.5 million iterations) through llmsim run
# peaked at 0.70 GB RSS, the interpreter's 0.2 GB included. These sizes give twice that, as above.
BYTES_PER_STREAMED_REQUEST = 600
BYTES_PER_STREAMED_ITERATION = 120
BYTES_PER_ENGINE = 40_000
EVENTS_PER_ENGINE = 100                 # building and reporting an engine takes as long as ~100 iterations
# A controller's wakeup reads every request's record: measured 150-260 us a wakeup with 2,000-8,000
# requests (Llama-3.1-8B / H100, 10 ms interval), the time of 4-7 iterations, growing with the records.
EVENTS_PER_CONTROL_TICK = 5
REQUESTS_PER_CONTROL_EVENT = 2_000
BYTES_PER_TICK = 200                    # a controller's or autoscaler's log row: a tuple of six numbers
BYTES_PER_KNOT = 64                     # an arrival profile's knot: about eight float64 arrays of them at once
SAFETY = 2.0                            # the fluid iteration count, doubled (it is an estimate, not a bound)
FLUID_ROUNDS = 30                       # fixed-point rounds for the mean batch (it settles in under ten)


@dataclass(frozen=True)
class RunEstimate:
    """What a run will take, at most (see the module docstring). ``sources`` splits the events and
    bytes by the scenario key that asks for them: (key, events, bytes)."""
    requests: int
    engines: int
    iterations: int
    memory_bytes: float
    sources: tuple[tuple[str, float, float], ...] = ()

    @property
    def events(self) -> int:
        return int(sum(events for _, events, _ in self.sources))

    def text(self) -> str:
        return (f"about {self.requests:,} requests on {self.engines:,} engines, up to {self.iterations:,} "
                f"iterations ({self.events:,} events) and {self.memory_bytes / 2**30:,.2f} GiB of memory")

    def largest(self, column: int) -> str:
        """The key behind the largest share of events (``column`` 1) or bytes (2)."""
        return max(self.sources, key=lambda source: source[column])[0]


def estimate_run(scenario: Scenario, trace: Trace | None = None, streamed: bool = False) -> RunEstimate:
    """The run's size from the scenario (and its trace, when already drawn or replayed); ``streamed``:
    its records and iteration log written and summed as it goes (``llmsim run`` of a long run), not kept."""
    workload = scenario.workload
    trace = workload.trace if trace is None else trace
    if trace is not None:
        requests = len(trace) if workload.num_requests is None else min(len(trace), workload.num_requests)
        window_s = float(trace.arrival_s[-1]) if len(trace) else 0.0
        prompt = float(trace.prompt_tokens.mean()) if len(trace) else 0.0
        output = float(trace.output_tokens.mean()) if len(trace) else 0.0
        longest = int(trace.output_tokens.max()) if len(trace) else 0
    else:
        rate = workload.rate_per_s
        if workload.duration_s is not None:
            expected = rate * workload.duration_s
            requests = math.ceil(expected + 6 * math.sqrt(expected))
            if workload.num_requests is not None:
                requests = min(requests, workload.num_requests)
        else:
            # A synthetic workload without a duration has a request count (the workload reader requires one).
            assert workload.num_requests is not None
            requests = workload.num_requests
        window_s = workload.duration_s if workload.duration_s is not None else requests / rate
        prompt, output, longest = _lengths(workload, requests)
    horizon_s = scenario.simulation.horizon_s
    if horizon_s is None:
        horizon_s = default_horizon_s(scenario, window_s, requests, prompt, output)
    resolved = ResolvedDeployment.of(scenario)
    serving = resolved.replicas * resolved.engines_per_replica
    per_request = output + math.ceil(prompt / scenario.engine.max_batch_tokens)
    # The fluid view misses the ends of a run: after the last arrival an engine may decode the
    # longest request alone, one iteration per token.
    fluid = _fluid_iterations(resolved, requests, window_s, horizon_s, prompt, output) + serving * longest
    iterations = min(requests * per_request, SAFETY * fluid)
    iterations = int(min(iterations, 1e18))
    request_bytes, iteration_bytes = ((BYTES_PER_STREAMED_REQUEST, BYTES_PER_STREAMED_ITERATION) if streamed
                                      else (BYTES_PER_REQUEST, BYTES_PER_ITERATION))
    sources: list[tuple[str, float, float]] = [
        ("workload", requests + iterations, requests * request_bytes + iterations * iteration_bytes)]
    sources += [(key, count * EVENTS_PER_ENGINE, count * BYTES_PER_ENGINE) for key, count in _engines(scenario)]
    control = EVENTS_PER_CONTROL_TICK + requests / REQUESTS_PER_CONTROL_EVENT
    for key, config, events in (("controller.interval", scenario.controller, control),
                                ("autoscaling.interval", scenario.autoscaling, 1.0)):
        if config is not None:
            ticks = horizon_s / config.interval_s
            sources.append((key, ticks * events, ticks * BYTES_PER_TICK))
    if trace is None:
        for key, profile in _profiles(workload):
            # Drawing a request count doubles the window until the arrivals fit: up to twice the window.
            sources.append((key, 0.0, profile.knot_count(2 * max(window_s, horizon_s)) * BYTES_PER_KNOT))
    engines = sum(count for _, count in _engines(scenario))
    memory = sum(size for _, _, size in sources)
    return RunEstimate(int(requests), engines, iterations, float(memory), tuple(sources))


def _engines(scenario: Scenario) -> list[tuple[str, int]]:
    """(key, engines) of every group of replicas the run builds: the deployment's (all an autoscaler
    may start) and each rollout group's, an engine per pipeline stage."""
    stages = scenario.deployment.pipeline_parallel * scenario.deployment.data_parallel
    if scenario.autoscaling is not None:
        return [("autoscaling.max_replicas", scenario.autoscaling.max_replicas * stages)]
    groups = [("deployment.replicas", scenario.deployment.replicas * stages)]
    if scenario.rollout is not None:
        groups += [(f"rollout.groups.{group.name}.replicas",
                    built.deployment.replicas * built.deployment.pipeline_parallel)
                   for group, built in zip(scenario.rollout.groups, group_scenarios(scenario))]
    return groups


def _profiles(workload) -> list[tuple[str, RateProfile]]:
    """(key, profile) of every time-varying arrival rate of a synthetic workload."""
    found = [("workload.arrival", workload.arrival)] + [(f"workload.classes.{c.name}.arrival", c.arrival)
                                                        for c in workload.classes]
    return [(f"{key}.{arrival.resolution_key}", arrival) for key, arrival in found if isinstance(arrival, RateProfile)]


def _lengths(workload, requests: int) -> tuple[float, float, int]:
    """(mean prompt, mean output, longest output) of ``requests`` synthetic requests: a dataset's
    own lengths, or the distributions' (every class's: the largest), six standard errors high."""
    if workload.dataset is not None:
        lengths = workload.dataset
        return (float(lengths.prompt_tokens.mean()), float(lengths.output_tokens.mean()),
                int(lengths.output_tokens.max()))
    prompts = [c.prompt_tokens for c in workload.classes if c.prompt_tokens is not None] + [workload.prompt_tokens]
    outputs = [c.output_tokens for c in workload.classes if c.output_tokens is not None] + [workload.output_tokens]
    prompts, outputs = [p for p in prompts if p is not None], [o for o in outputs if o is not None]
    return (max(_high_mean(p, requests) for p in prompts), max(_high_mean(o, requests) for o in outputs),
            max(o.maximum for o in outputs))


def _high_mean(length, requests: int) -> float:
    """The mean length of ``requests`` draws, six standard errors high: what the sample will not exceed."""
    return length.mean() + 6 * math.sqrt(length.variance() / max(requests, 1))


def _fluid_iterations(resolved: ResolvedDeployment, requests: int, window_s: float, horizon_s: float,
                      prompt: float, output: float) -> float:
    """Iterations of every engine in a fluid view of the run: each engine's mean batch ``B`` solves
    Little's law, ``B = (arrivals per second per engine) x (output tokens) x (iteration time at
    batch B)`` (each request stays one iteration per output token), the iteration time priced by the
    cost model at the mean context; the iterations are the engine's output tokens over ``B``. An
    engine that cannot keep up runs full batches until the horizon. Prefill work is left out: it
    lengthens iterations, so the count it gives is high, not low."""
    engines = resolved.replicas * resolved.engines_per_replica
    most = max(1, resolved.engine.max_num_seqs)
    context = int(min(prompt + output / 2, resolved.memory.kv_capacity_tokens))
    per_engine_rate = requests / max(window_s, 1e-9) / engines
    batch = 1.0
    for _ in range(FLUID_ROUNDS):
        demand = per_engine_rate * output * resolved.cost.decode_time(int(round(batch)), context)
        batch = min(max(demand, 1.0), most)
    if per_engine_rate * output * resolved.cost.decode_time(most, context) > most:      # overloaded
        return engines * horizon_s / resolved.cost.decode_time(most, context)
    return requests * output / batch


def check_run_size(scenario: Scenario, trace: Trace | None = None, force: bool = False,
                   streamed: bool = False) -> RunEstimate:
    """The run's estimate; above the limits a ConfigError (exit 2) giving it and the override."""
    estimate = estimate_run(scenario, trace, streamed)
    if force:
        return estimate
    over: list[str] = []
    key: str | None = None
    if estimate.engines > MAX_RUN_ENGINES:
        over.append(f"{MAX_RUN_ENGINES:,} engines (replicas x pipeline stages)")
        key = max(_engines(scenario), key=lambda group: group[1])[0]
    if estimate.events > MAX_RUN_EVENTS:
        over.append(f"{MAX_RUN_EVENTS:,} events")
        key = key or estimate.largest(1)
    if estimate.memory_bytes > MAX_RUN_MEMORY_BYTES:
        over.append(f"{MAX_RUN_MEMORY_BYTES / 2**30:g} GiB of memory")
        key = key or estimate.largest(2)
    if over:
        assert key is not None          # every limit passed above names a key
        raise ConfigError(f"this run is too large to start unasked: {estimate.text()}, above the limit of "
                          f"{' and '.join(over)}", file=scenario.path, key=key, has_value=False,
                          allowed=f"{REMEDIES.get(key.rsplit('.', 1)[-1], REMEDIES['workload']).format(key=key)}; "
                                  "or --force (llmsim run, compare, sweep; force=True in Python) to run it anyway")
    return estimate


# What to change, by the last part of the key a refusal names.
REMEDIES = {
    "workload": "fewer workload.num_requests, a shorter workload.duration or a shorter simulation.horizon",
    "replicas": "fewer {key}", "max_replicas": "a smaller {key}",
    "interval": "a longer {key} (it wakes once per interval until simulation.horizon) or a shorter horizon",
    "period": "a longer {key} (the rate is integrated on 1,440 knots per period) or a shorter window",
    "states": "longer mean_duration in {key} (about one knot per state visited) or a shorter window",
    "rates": "fewer points in {key}",
}
