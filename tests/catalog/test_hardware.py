"""Hardware profiles: every figure says where it came from, and bad profiles are rejected."""
from __future__ import annotations

import pytest
import yaml

from llmsim import hardware_catalog, load_profile
from llmsim.errors import ConfigError
from llmsim.catalog.hardware import shipped_profile_dir
from llmsim.catalog.kernel_terms import EngineKernels

PROFILES = sorted(shipped_profile_dir().glob("*.yaml"))
REFERENCE = {  # docs/reference/sources/hardware.md: dense BF16 TFLOP/s, memory GB, bandwidth TB/s, TDP W
    "A100-80GB": (312, 80, 2.039, 400), "H100-SXM": (989.4, 80, 3.35, 700), "H200": (989, 141, 4.8, 700),
    "B200": (2250, 180, 8.0, 1000), "MI300X": (1307.4, 192, 5.3, 750),
}
# Profiles whose capacity is what the driver exposes (NVML's total): the datasheet's "80GB" and "141GB" count binary
# gigabytes (NVIDIA's aiconfigurator-core systems/*.yaml: 80 GiB, 141 GiB), of which NVML shows all but under 1%.
NVML_CAPACITY = {"H100-SXM", "H200"}


def figures_in(node, path=""):
    """Key paths of every {value: ...} mapping in a raw profile (the figures), walking lists too."""
    if isinstance(node, dict) and "value" in node:
        yield path
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from figures_in(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from figures_in(value, f"{path}[{index}]")


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_every_figure_names_its_source(path):
    profile = load_profile(path)
    assert set(profile.figures) == set(figures_in(yaml.safe_load(path.read_text())))
    for figure in profile.figures.values():
        assert figure.source.strip()
        if figure.confidence in ("assumption", "unverified"):
            assert figure.confidence in figure.source or figure.source.startswith(("assumption", "unverified"))


def test_gpu_profiles_match_the_reference_table():
    catalog = hardware_catalog()
    for name, (tflops, memory_gb, bandwidth_tbs, tdp) in REFERENCE.items():
        hw = catalog[name]
        assert hw.peak_for("bf16") == pytest.approx(tflops * 1e12)
        if name in NVML_CAPACITY:
            assert 0.99 * memory_gb * 2**30 <= hw.memory_capacity_bytes <= memory_gb * 2**30
        else:
            assert hw.memory_capacity_bytes == pytest.approx(memory_gb * 1e9)
        assert hw.memory_bandwidth_bytes_per_s == pytest.approx(bandwidth_tbs * 1e12)
        assert hw.tdp_w == pytest.approx(tdp)


def test_a_figure_without_a_source_is_rejected(tmp_path):
    raw = yaml.safe_load(PROFILES[0].read_text())
    del raw["memory_bandwidth"]["source"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="memory_bandwidth.source"):
        load_profile(path)
    raw = yaml.safe_load(PROFILES[0].read_text())
    raw["memory_bandwidth"]["value"] = "3.35 TFLOP/s"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="bandwidth"):
        load_profile(path)


def test_a_profile_edited_within_the_process_is_read_again_and_copies_are_independent(tmp_path):
    """load_profile parses a file once per content: an edit (same size, same second) is seen at once,
    and a caller that changes its profile does not change what the next caller gets."""
    shipped = shipped_profile_dir() / "h100-sxm.yaml"
    path = tmp_path / "chip.yaml"
    document = yaml.safe_load(shipped.read_text())
    document["tdp"]["value"] = 700
    path.write_text(yaml.safe_dump(document))
    assert load_profile(path).tdp_w == 700
    document["tdp"]["value"] = 600                   # the same number of characters
    path.write_text(yaml.safe_dump(document))
    assert load_profile(path).tdp_w == 600
    first = load_profile(shipped)
    peak = first.peak_flops_per_s["bf16"]
    first.peak_flops_per_s["bf16"] = 1.0
    assert load_profile(shipped).peak_flops_per_s["bf16"] == peak


def test_a_chip_is_found_by_each_of_its_aliases_and_no_name_means_two_chips():
    from llmsim import lookup_hardware
    catalog = hardware_catalog()
    taken = {name.lower(): name for name in catalog} | {p.stem.lower(): catalog_name
                                                       for p in PROFILES
                                                       for catalog_name in [load_profile(p).name]}
    assert lookup_hardware("H100").name == "H100-SXM" and lookup_hardware("wse-3").name == "CS-3"
    for profile in catalog.values():
        for alias in profile.aliases:
            assert lookup_hardware(alias).name == profile.name
            assert taken.setdefault(alias.lower(), profile.name) == profile.name, alias


def named_in_catalog(name: str) -> str | None:
    """The reference for a lookup by alias: the catalog's first profile (by name, the first found wins) with
    that name or alias, every profile on the path parsed."""
    return next((profile_name for profile_name, profile in hardware_catalog().items()
                 if name.lower() in (profile_name.lower(), *(a.lower() for a in profile.aliases))), None)


def test_an_alias_lookup_parsing_only_the_files_that_mention_it_finds_what_the_whole_catalog_finds(
        tmp_path, monkeypatch):
    """Two search folders: a chip named like a shipped one, whose alias only it has (hidden behind the shipped
    one, which comes first by name, so the alias finds nothing, as in the catalog), and one of a new name whose
    alias a shipped chip's text mentions; every name, alias and file stem of every profile is looked up too."""
    from llmsim import lookup_hardware
    from llmsim.catalog.hardware import _named
    raw = yaml.safe_load((shipped_profile_dir() / "h100-sxm.yaml").read_text())
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    (first / "zz-h100.yaml").write_text(yaml.safe_dump({**raw, "aliases": ["H100"]}))
    (second / "shadowed.yaml").write_text(yaml.safe_dump({**raw, "aliases": ["only-here"]}))
    (second / "renamed.yaml").write_text(yaml.safe_dump({**raw, "name": "Renamed-H100", "aliases": ["nvbandwidth"]}))
    monkeypatch.setenv("LLMSIM_PROFILE_PATH", f"{first}:{second}")
    names = {"only-here", "nvbandwidth", "no-such-chip", *(n for profile in hardware_catalog().values()
                                                   for n in (profile.name, *profile.aliases))}
    assert "nvbandwidth" in (shipped_profile_dir() / "h100-sxm.yaml").read_text().lower()     # its text mentions it
    for name in sorted(names):
        found = _named(name)
        assert (found.name if found else None) == named_in_catalog(name), name
    assert _named("only-here") is None and _named("nvbandwidth").name == "Renamed-H100"
    with pytest.raises(ConfigError, match="unknown hardware profile"):
        lookup_hardware("only-here")


def test_a_profile_file_is_parsed_once_per_text_and_its_data_left_as_parsed(tmp_path, monkeypatch):
    """The same text on two paths is parsed once; building the profile leaves the shared data equal to a fresh
    parse of the file (the report's appendix and standing read it)."""
    import llmsim.catalog.hardware as hardware
    from llmsim.catalog.hardware import profile_data
    text = (shipped_profile_dir() / "h200.yaml").read_text() + "\n# a copy\n"
    paths = [tmp_path / "one.yaml", tmp_path / "two.yaml"]
    for path in paths:
        path.write_text(text)
    parsed = []
    monkeypatch.setattr(hardware, "parse_yaml", lambda text, file=None: parsed.append(file) or yaml.safe_load(text))
    assert {load_profile(path).name for path in paths} == {"H200"}
    assert parsed == [str(paths[0])]
    assert profile_data(paths[1]) == yaml.safe_load(text) and parsed == [str(paths[0])]


@pytest.mark.parametrize("aliases", ["H100", [""], [3], {"a": 1}])
def test_aliases_must_be_a_list_of_names(tmp_path, aliases):
    raw = yaml.safe_load((shipped_profile_dir() / "h100-sxm.yaml").read_text())
    raw["aliases"] = aliases
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="aliases"):
        load_profile(path)


def test_h200_tensorrt_llm_streaming_kernels_follow_their_stated_transfer_rule():
    """The H200's TensorRT-LLM SiLU and add-norm bandwidths are an assumption stated in the profile: H100's measured
    kernels' share of its 3.35 TB/s peak, times H200's 4.8 TB/s (both datasheet figures), to the profile's 4
    significant figures; the vLLM terms keep the H200's own measured figures."""
    catalog = hardware_catalog()
    h100, h200 = catalog["H100-SXM"], catalog["H200"]
    assert (h100.memory_bandwidth_bytes_per_s, h200.memory_bandwidth_bytes_per_s) == (3.35e12, 4.8e12)
    trtllm = h200.for_engine(EngineKernels.TRTLLM).kernels.elementwise
    vllm = h200.for_engine(EngineKernels.VLLM).kernels.elementwise
    for kind in ("activation", "norm"):
        share = h100.kernels.elementwise[kind].bandwidth_bytes_per_s / h100.memory_bandwidth_bytes_per_s
        assert trtllm[kind].bandwidth_bytes_per_s == pytest.approx(share * 4.8e12, rel=5e-4), kind
        assert vllm[kind].bandwidth_bytes_per_s == h200.kernels.elementwise[kind].bandwidth_bytes_per_s
        assert trtllm[kind].floor_s == vllm[kind].floor_s


def test_nccl_all_reduce_prices_the_middle_protocol_where_the_profile_has_it(tmp_path):
    """An all-reduce entry with NCCL's middle protocol line (medium_latency, medium_bus_bandwidth) is priced by the
    fastest of three alpha-beta lines: a message on that line costs its latency plus 2 (g - 1) / g of it over its
    bandwidth; one figure of the pair without the other is refused, naming the missing key."""
    from llmsim.cost.kernels import all_reduce_time_s
    raw = yaml.safe_load((shipped_profile_dir() / "a100-80gb.yaml").read_text())
    entry = raw["kernels"]["all_reduce"][8]
    source = {"source": "assumption: a test line", "confidence": "assumption"}
    for key in ("medium_latency", "medium_bus_bandwidth"):
        entry.pop(key, None)
    entry.update(latency={"value": "10 us", **source}, bus_bandwidth={"value": "10 GB/s", **source},
                 large_latency={"value": "100 us", **source}, large_bus_bandwidth={"value": "400 GB/s", **source},
                 medium_latency={"value": "20 us", **source})
    path = tmp_path / "chip.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"all_reduce\.8\.medium_bus_bandwidth"):
        load_profile(path)
    entry["medium_bus_bandwidth"] = {"value": "200 GB/s", **source}
    path.write_text(yaml.safe_dump(raw))
    reduce = load_profile(path).kernels.all_reduce[8]
    share = 2 * 7 / 8
    # 8 MB: small 10 us + 1.4 ms, large 100 us + 35 us, medium 20 us + 70 us: the medium line.
    assert float(all_reduce_time_s(8e6, 8, reduce)) == pytest.approx(20e-6 + share * 8e6 / 200e9)
    # 800 MB: the large line; 1 KB: the small one.
    assert float(all_reduce_time_s(8e8, 8, reduce)) == pytest.approx(100e-6 + share * 8e8 / 400e9)
    assert float(all_reduce_time_s(1e3, 8, reduce)) == pytest.approx(10e-6 + share * 1e3 / 10e9)
