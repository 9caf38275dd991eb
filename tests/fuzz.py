"""Generated bad input, and the contract every command keeps on it (tests/config/test_fuzz_inputs.py,
benchmarks/fuzz_inputs.py).

The cases are generated from the schema, not listed by hand: scenario mutations pick key paths
from the shipped scenarios (every key a scenario file can have) and set them to hostile values
(numbers of 400 digits, NaN, negative sizes, units that do not exist, wrong types, deep
nesting), drop them or add keys that do not exist; comparisons, grids and traces are built
around such values; flag sets come from the command-line parser's own options.

The contract (:func:`run_case`): run in this process with a time budget, every case ends with
exit status 0 and a valid result (a run's summary.json matches its requests.csv), or exit 2
and one paragraph on stderr starting with ``llmsim:``; never an exception out of ``main``
(a traceback), never past the budget (a hang). While the cases run, the resource guard's
limits are lowered (:func:`small_guard`) so that any run it admits ends within seconds: the
time and memory a case may take are the guard's to bound, and this checks that it does.
"""
from __future__ import annotations

import contextlib
import io
import json
import signal
import string
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from hypothesis import strategies as st

from llmsim.cli.main import main
from llmsim.sim import resources

from tests.helpers import REPO

BUDGET_S = 60.0                 # a case past this is a hang (the guard admits runs of a few seconds)
GUARD_EVENTS = 60_000           # the guard's limits while fuzzing
GUARD_MEMORY_BYTES = 256 * 2**20

# A small valid scenario: mutations of it that are still valid run in well under a second.
SMALL = {
    "name": "fuzz", "seed": 3, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
    "deployment": {"replicas": 1, "tensor_parallel": 1, "router": "least_outstanding"},
    "engine": {"batching": "continuous", "max_num_seqs": 64, "max_batch_tokens": 4096, "chunked_prefill": True,
               "block_size": 128, "memory_utilization": 0.9, "max_model_len": 8192},
    "workload": {"arrival": {"process": "poisson", "rate": "20/s"}, "num_requests": 40,
                 "prompt_tokens": {"distribution": "lognormal", "mean": 300, "sigma": 0.8, "max": 4096},
                 "output_tokens": {"distribution": "lognormal", "mean": 60, "sigma": 0.8, "max": 1024}},
    "slo": {"ttft": "500 ms", "tpot": "50 ms"},
    "simulation": {"warmup": "1 s"},
}


def _paths(value, prefix: str = "") -> set[str]:
    """Every dotted key path of a mapping (into nested mappings)."""
    found = set()
    if isinstance(value, dict):
        for key, child in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            found.add(path)
            found |= _paths(child, path)
    return found


def schema_paths() -> list[str]:
    """The key paths of every shipped scenario and of :data:`SMALL`: the scenario schema as files use it."""
    paths = _paths(SMALL)
    for path in sorted((REPO / "scenarios").glob("*.yaml")):
        paths |= _paths(yaml.safe_load(path.read_text()))
    return sorted(paths)


PATHS = schema_paths()
UNITS = ["", " ms", " s", " h", "/s", " req/min", " GB", " GiB", " TB/s", " parsecs", " W", "%"]

# Values people mistype and adversaries choose. No subnormal floats: flush-to-zero is process-wide, and
# torch holds it on while a calibration in the same process measures, under which hypothesis refuses to
# draw them; 1e-300 below still stands for a tiny positive number.
numbers = st.one_of(
    st.integers(min_value=-10, max_value=10),
    st.sampled_from([0, 1, 2, 3, 7, 64, 128, 4096, 10**6, 10**9, 2**53 + 1, 2**63, 10**400, -10**400]),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
    st.sampled_from([1e-300, 1e300, -0.0, 0.5, 1.5, float("nan"), float("inf")]),
)
texts = st.one_of(
    st.builds(lambda n, unit: f"{n}{unit}", st.sampled_from(["5", "0", "-3", "1e9", "1e400", "nan", "0.001", "100"]),
              st.sampled_from(UNITS)),
    st.sampled_from(["", "auto", "lots", "Llama-3.1-7B", "H1OO", "poisson", "gamma", "trace", "static", "\x00",
                     "é" * 3, "../../etc", "/dev/zero", "scenarios", "x" * 500]),
    st.text(alphabet=string.printable, max_size=12),
)
scalars = st.one_of(numbers, texts, st.booleans(), st.none())


def _nested(depth: int):
    value = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


values = st.one_of(
    scalars, scalars, scalars,
    st.lists(scalars, max_size=3),
    st.dictionaries(st.sampled_from(["a", "rate", "mean", "value", "process"]), scalars, max_size=3),
    st.integers(min_value=60, max_value=200).map(_nested),
)


@dataclass
class Case:
    """Files to write into a fresh folder and the command line to run there ({dir} is that folder)."""
    argv: list[str]
    files: dict[str, str | bytes] = field(default_factory=dict)

    def write(self, folder: Path) -> list[str]:
        for name, content in self.files.items():
            path = folder / name
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
        return [arg.replace("{dir}", str(folder)) for arg in self.argv]


def _set(data: dict, path: str, value, delete: bool = False) -> dict:
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if delete:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return data


@st.composite
def mutated_scenarios(draw) -> dict:
    """:data:`SMALL` with one to three keys set to hostile values, dropped, or unknown keys added."""
    data = json.loads(json.dumps(SMALL))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        action = draw(st.sampled_from(["set", "set", "set", "delete", "unknown"]))
        path = draw(st.sampled_from(PATHS))
        if action == "unknown":
            path = path.rsplit(".", 1)[0] + "." + draw(st.sampled_from(["bogus", "max_num_seq", "tensor_paralel"]))
        _set(data, path, draw(values), delete=action == "delete")
    return data


def _dump(data) -> str:
    """YAML for any value: safe_dump where it can, else a repr-like fallback that YAML still reads."""
    try:
        return yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, RecursionError, ValueError):
        return json.dumps(data, default=str)


def _run(name: str = "scenario.yaml") -> list[str]:
    return ["run", f"{{dir}}/{name}", "--out", "{dir}/out"]


@st.composite
def scenario_cases(draw) -> Case:
    return Case(_run(), {"scenario.yaml": _dump(draw(mutated_scenarios()))})


raw_files = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"\xff\xfen\x00a\x00m\x00e\x00", "name: café\n".encode("latin-1"), b"a: [" * 3000,
                     b"{a: " * 200 + b"1" + b"}" * 200, b"a: &a [x,x,x,x,x,x,x,x,x]\n" + b"".join(
                         b"%c: &%c [*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c]\n" % ((98 + i, 98 + i) + (97 + i,) * 9)
                         for i in range(9)), b"\x00" * 100, b"- 1\n- 2\n", b"42\n", b"", b"a: b: c\n"]),
)


@st.composite
def raw_file_cases(draw) -> Case:
    """Files that are not a scenario at all: binary, other encodings, deep nesting, alias bombs."""
    return Case(_run(), {"scenario.yaml": draw(raw_files)})


# Valid changes, so that some generated comparisons and grids run (and are checked) end to end.
VALID_CHANGES = {"engine.max_num_seqs": [16, 32], "workload.arrival.rate": [5, "10/s"],
                 "engine.chunked_prefill": [True, False], "deployment.replicas": [1, 2],
                 "engine.max_batch_tokens": [2048, 4096], "workload.num_requests": [20]}
valid_variants = st.sampled_from(list(VALID_CHANGES)).flatmap(
    lambda path: st.sampled_from(VALID_CHANGES[path]).map(lambda value: _set({}, path, value)))
valid_loads = st.sampled_from([5, "10/s", "600 req/min", {"rate": 8, "num_requests": 30}])


@st.composite
def comparison_cases(draw) -> Case:
    loads = draw(st.one_of(
        st.dictionaries(st.sampled_from(["low", "high"]), valid_loads, max_size=2),
        st.dictionaries(st.sampled_from(["low", "high"]), st.one_of(values, st.fixed_dictionaries(
            {"rate": values}, optional={"num_requests": values, "bogus": values})), max_size=2),
        values))
    variants = draw(st.one_of(
        st.dictionaries(st.sampled_from(["a", "b"]), valid_variants, min_size=1, max_size=2),
        st.dictionaries(st.sampled_from(["a", "b"]), st.builds(lambda p, v: _set({}, p, v),
                                                                st.sampled_from(PATHS), values), max_size=2),
        values))
    comparison = {"base": SMALL, "variants": variants, "loads": loads}
    if draw(st.integers(0, 3)) == 0:
        comparison[draw(st.sampled_from(["bogus", "variant", "name"]))] = draw(values)
    return Case(["compare", "{dir}/comparison.yaml"], {"comparison.yaml": _dump(comparison)})


@st.composite
def grid_cases(draw) -> Case:
    grid = draw(st.one_of(
        st.lists(st.sampled_from(list(VALID_CHANGES)), min_size=1, max_size=2).map(
            lambda paths: {path: VALID_CHANGES[path] for path in paths}),
        st.dictionaries(st.sampled_from(PATHS + ["bogus.key", "seed"]), st.one_of(
            st.lists(values, min_size=0, max_size=3), values), max_size=2),
        values))
    return Case(["sweep", "{dir}/scenario.yaml", "--grid", "{dir}/grid.yaml", "--out", "{dir}/sweep",
                 "--engine", "serial"], {"scenario.yaml": _dump(SMALL), "grid.yaml": _dump(grid)})


cells = st.one_of(
    st.sampled_from(["0", "1", "10", "0.5", "1.5", "-1", "inf", "-inf", "nan", "NaN", "", "abc", "1e30", "1e400",
                     "99999999999999999999999", "1e9", "2e9", '"5"', "é", "0x10"]),
    st.integers(min_value=-5, max_value=5000).map(str),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False).map(repr),
)


TRACE_COLUMNS = [["arrival_s", "prompt_tokens", "output_tokens"], ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
                 ["Timestamp", "Request tokens", "Response tokens", "Model", "Log Type"]]


@st.composite
def mooncake_lines(draw) -> str:
    """Mooncake JSON lines with hostile numbers (Python's json writes NaN and Infinity, and reads them)."""
    records = draw(st.lists(st.fixed_dictionaries(
        {"timestamp": st.one_of(numbers, texts), "input_length": numbers, "output_length": numbers},
        optional={"hash_ids": st.one_of(st.lists(st.integers(), max_size=3), values)}), max_size=6))
    return "\n".join(json.dumps(record) for record in records) + draw(st.sampled_from(["", "\n", "\n{", "\n[1]"]))


@st.composite
def valid_trace_text(draw) -> str:
    """A trace that replays: sorted arrival times, whole token counts within the model's context."""
    row = st.tuples(st.floats(0, 2, allow_subnormal=False), st.integers(1, 3000), st.integers(1, 500))
    rows = draw(st.lists(row, min_size=1, max_size=20))
    times = [sum(gap for gap, _, _ in rows[:i + 1]) for i in range(len(rows))]
    return "arrival_s,prompt_tokens,output_tokens\n" + "".join(
        f"{t!r},{p},{o}\n" for t, (_, p, o) in zip(times, rows))


@st.composite
def trace_cases(draw) -> Case:
    columns = draw(st.one_of(st.sampled_from(TRACE_COLUMNS),
                             st.lists(st.sampled_from(["arrival_s", "prompt_tokens", "output_tokens", "x", ""]),
                                      max_size=4)))
    rows = draw(st.lists(st.lists(cells, min_size=len(columns), max_size=len(columns) + 1), max_size=12))
    text = "\n".join([",".join(columns)] + [",".join(row) for row in rows]) + "\n"
    content = draw(st.one_of(st.just(text), st.just(text), valid_trace_text(), mooncake_lines(), raw_files))
    scenario = json.loads(json.dumps(SMALL))
    scenario["workload"] = {"arrival": {"process": "trace", "path": "trace.csv"}}
    if draw(st.booleans()):
        scenario["workload"][draw(st.sampled_from(["num_requests", "duration"]))] = draw(values)
    return Case(_run(), {"scenario.yaml": _dump(scenario), "trace.csv": content})


def _flag_values():
    return st.one_of(st.sampled_from(["-2", "0", "1", "3", "7", "1e8", "100000000", "nan", "inf", "-0.5", "0.5", "1.5",
                                      "fp5", "fp8", "bf16", "int4", "", "x", "10" * 300]), st.text(max_size=6))


@st.composite
def flag_cases(draw) -> Case:
    """A command and flags drawn from the parser's own options, each with a hostile value."""
    from llmsim.cli.main import build_parser
    command = draw(st.sampled_from(["place", "run", "compare", "sweep"]))
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[command]
    options = [a for a in sub._actions if a.option_strings and a.option_strings[0] != "-h"]
    argv = {"place": ["place", draw(st.sampled_from(["Llama-3.1-8B", "Mixtral-8x7B", "nope"])),
                      draw(st.sampled_from(["H100-SXM", "CS-3", "nope"]))],
            "run": _run(), "compare": ["compare", "{dir}/comparison.yaml"],
            "sweep": ["sweep", "{dir}/scenario.yaml", "--grid", "{dir}/grid.yaml", "--engine", "serial"]}[command]
    for action in draw(st.lists(st.sampled_from(options), max_size=3, unique_by=lambda a: a.dest)):
        if action.dest == "engine":         # dask starts a local cluster: slow, and covered by its own test
            continue
        argv.append(action.option_strings[0])
        if action.nargs != 0:
            argv.append(draw(_flag_values()))
    files = {"scenario.yaml": _dump(SMALL), "grid.yaml": _dump({"engine.max_num_seqs": [16, 32]}),
             "comparison.yaml": _dump({"base": SMALL, "variants": {"a": {}}})}
    return Case(argv, files)


KINDS = {"scenario": scenario_cases, "raw file": raw_file_cases, "comparison": comparison_cases,
         "grid": grid_cases, "trace": trace_cases, "flags": flag_cases}


class Hang(BaseException):
    """The case ran past its budget (a BaseException, so that no ``except Exception`` swallows it)."""


@dataclass
class Outcome:
    status: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def small_guard():
    """The resource guard's limits lowered while fuzzing (see the module docstring)."""
    saved = resources.MAX_RUN_EVENTS, resources.MAX_RUN_MEMORY_BYTES
    resources.MAX_RUN_EVENTS, resources.MAX_RUN_MEMORY_BYTES = GUARD_EVENTS, GUARD_MEMORY_BYTES
    try:
        yield
    finally:
        resources.MAX_RUN_EVENTS, resources.MAX_RUN_MEMORY_BYTES = saved


def run_case(case: Case, folder: Path, budget_s: float = BUDGET_S) -> Outcome:
    """Run ``case`` in ``folder`` through ``main`` in this process and check the contract."""
    argv = case.write(folder)
    out, err = io.StringIO(), io.StringIO()

    def expire(signum, frame):
        raise Hang(f"{argv} ran past {budget_s:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    try:
        with small_guard(), contextlib.chdir(folder), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            status = main(argv)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    outcome = Outcome(status, out.getvalue(), err.getvalue())
    check_contract(argv, outcome, folder)
    return outcome


def check_contract(argv: list[str], outcome: Outcome, folder: Path) -> None:
    """Exit 0 with a valid result, or exit 2 with one paragraph."""
    assert "Traceback" not in outcome.stderr, outcome.stderr
    if outcome.status == 2:
        paragraph = outcome.stderr.strip().splitlines()[-1] if outcome.stderr.strip() else ""
        assert paragraph.startswith("llmsim: ") and len(paragraph) > 30, (argv, outcome.stderr)
        return
    assert outcome.status == 0, (argv, outcome)
    if argv[0] == "run":
        out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
        if out is not None and out.is_dir():
            summary = json.loads((out / "summary.json").read_text())
            rows = (out / "requests.csv").read_text().count("\n") - 1
            assert summary["requests"]["arrived"] == rows, (summary["requests"], rows)
            assert summary["stopped_by"] in ("completed", "horizon"), summary["stopped_by"]
    elif argv[0] in ("compare", "sweep", "place"):
        assert outcome.stdout.strip(), outcome
