"""Per-layer sliding windows (Gemma-2 every other layer, Gemma-3 five in six, Mistral all): the attention
work of a local layer is bounded by the window, a global layer's by the context.

The truth is the closed form summed over the layers: a context ``c > W`` costs ``n_global c + n_local W``
tokens of KV per token, times the bytes of one layer's KV, and no window leaves everything as it was.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from llmsim import model_catalog
from llmsim.catalog.hardware import lookup_hardware
from llmsim.cli.main import main
from llmsim.cost.features import F, batch_features, chunk_pairs, prefill_sums
from llmsim.cost.roofline import CostModel
from llmsim.cost.work import LAYER_OPS, work_coefficients
from tests.helpers import REPO, make_scenario, roofline_only, simulate_checked

MISTRAL = model_catalog()["Mistral-7B-v0.1"]          # 32 layers, a 4,096-token window on every one
WINDOW = MISTRAL.sliding_window
GEMMA2_LIKE = replace(MISTRAL, sliding_window_layers=16)     # every other layer local
GEMMA3_LIKE = replace(MISTRAL, sliding_window_layers=27)     # 27 local, 5 global
GLOBAL = replace(MISTRAL, sliding_window=None)
DECODE, PREFILL, KV_WRITE = (LAYER_OPS.index(op) for op in ("attention_decode", "attention_prefill", "kv_write"))


def kv_bytes(model, x):
    """KV bytes all layers move for batch ``x`` (one shard): the work's KV rows summed over the layers."""
    return model.num_layers * work_coefficients(model).layer_bytes["kv"] @ x


@pytest.mark.parametrize("model", [GEMMA2_LIKE, GEMMA3_LIKE, MISTRAL, GLOBAL], ids=["2:2", "27:5", "all", "none"])
def test_decode_kv_bytes_are_global_context_plus_local_window(model):
    per_layer = model.kv_bytes_per_token_per_layer
    n_local = model.local_layers
    n_global = model.num_layers - n_local
    for context in (1000, WINDOW - 1, 3 * WINDOW, 20_000):
        x = batch_features([], [], [context] * 3, 0, model)
        reads = context + 1                              # the new token attends to its own key too
        expected = 3 * (n_global * reads + n_local * min(reads, WINDOW) + model.num_layers) * per_layer   # + writes
        assert kv_bytes(model, x)[[DECODE, KV_WRITE]].sum() == pytest.approx(expected, rel=1e-12)


def test_prefill_attention_flops_and_kv_reads_by_layer_kind():
    model, cached, new = GEMMA2_LIKE, 10_000, 512
    x = batch_features([new], [cached], [], 1, model)
    n_local = n_global = 16
    pairs_global = new * cached + new * (new + 1) / 2
    pairs_local = new * WINDOW                           # every query of the chunk sees the last W tokens
    flops = model.num_layers * work_coefficients(model).layer_flops[PREFILL] @ x
    assert flops == pytest.approx(4 * model.q_dim * (n_global * pairs_global + n_local * pairs_local), rel=1e-12)
    reads = (n_global * (cached + new) + n_local * (WINDOW + new) + model.num_layers * new) \
        * model.kv_bytes_per_token_per_layer
    assert kv_bytes(model, x)[[PREFILL, KV_WRITE]].sum() == pytest.approx(reads, rel=1e-12)


@pytest.mark.parametrize("share", [1.0, 0.5], ids=["every-layer", "half-the-layers"])
def test_chunk_pairs_count_every_query_key_pair_inside_the_window(share):
    """A chunk of ``new`` positions after ``cached``: query i (from 1) sees min(cached + i, W) keys on a local
    layer (the window bounds the chunk's own positions too), cached + i on a global one; counted one by one.
    The simulator's scalar sums, the vectorised rows and the fluid model's function agree with the count."""
    model = MISTRAL if share == 1.0 else GEMMA2_LIKE
    for cached, new in [(0, 100), (0, 9000), (3000, 2000), (4095, 1), (4096, 7), (10_000, 512), (100, 3996)]:
        local = sum(min(cached + i, WINDOW) for i in range(1, new + 1))
        full = sum(cached + i for i in range(1, new + 1))
        brute = share * local + (1 - share) * full
        assert chunk_pairs(new, cached, WINDOW, share) == pytest.approx(brute, rel=1e-15)

        class Chunk:
            prefilled, prefill_target = cached, cached + new
        assert prefill_sums([(Chunk(), new)], WINDOW, share)[1] == pytest.approx(brute, rel=1e-15)
        assert batch_features([new], [cached], [], 1, model)[F["prefill_pairs"]] == pytest.approx(brute, rel=1e-15)


def test_no_window_and_every_layer_windowed_are_the_old_formulas():
    """A model without a window, and one whose window covers all its layers, give the same rows bit for bit
    as the single-window arithmetic (``sliding_window_layers`` 0 is no window; all layers is Mistral)."""
    prefill, contexts, decodes = [700, 64], [0, 9000], [12, 4095, 4096, 30_000]
    x_none = batch_features(prefill, contexts, decodes, 1, GLOBAL)
    assert np.array_equal(batch_features(prefill, contexts, decodes, 1, replace(MISTRAL, sliding_window_layers=0)),
                          x_none)
    assert np.array_equal(x_none[[F["prefill_kv_read"], F["decode_kv_read"]]],
                          [700 + 9000 + 64, sum(c + 1 for c in decodes)])
    x_all = batch_features(prefill, contexts, decodes, 1, MISTRAL)
    assert np.array_equal(batch_features(prefill, contexts, decodes, 1, replace(MISTRAL, sliding_window_layers=32)),
                          x_all)
    assert x_all[F["decode_kv_read"]] == sum(min(c + 1, WINDOW) for c in decodes)


@pytest.mark.parametrize("profile", ["kernels", "roofline"])
def test_both_cost_paths_price_local_layers_below_global_ones(profile):
    """The measured-kernel path and the roofline take the same attention work: a long context costs the
    mixed model less than all-global and more than all-local; below the window all three cost the same."""
    h100 = lookup_hardware("H100-SXM")
    hardware = h100 if profile == "kernels" else roofline_only(h100)
    assert (hardware.kernels is not None) == (profile == "kernels")
    costs = [CostModel(m, hardware) for m in (MISTRAL, GEMMA2_LIKE, GLOBAL)]
    local, mixed, glob = (c.decode_time(64, 32_000) for c in costs)
    assert local < mixed < glob
    local, mixed, glob = (c.prefill_time(2048, 30_000) for c in costs)
    assert local < mixed < glob
    assert len({c.decode_time(64, 2000) for c in costs}) == 1
    # The kernel path's prefill attention is its FLOPs at the backend's rate: in the mixed model's FLOPs.
    table = costs[1].breakdown(costs[1].features([2048], [30_000], [])).set_index("operator")
    pairs = 16 * (2048 * 30_000 + 2048 * 2049 / 2) + 16 * 2048 * WINDOW
    assert table.loc["layer.attention_prefill", "flops"] == pytest.approx(4 * MISTRAL.q_dim * pairs, rel=1e-12)


def test_the_simulators_decode_reads_follow_the_layer_split():
    """Every iteration of a simulated run: the closed-form KV the decode set reads equals a recount of
    ``n_global (c + 1) + n_local min(c + 1, W)`` over the decoding sequences, per layer."""
    checked = {"iterations": 0}

    def recount(engine, iteration):
        decode = engine.decode
        decoding = [r for r in engine.running.values() if r not in engine.prefilling]
        contexts = [decode.context(r) for r in decoding]
        model = engine.cost.model
        n_local = model.local_layers
        brute = sum((model.num_layers - n_local) * (c + 1) + n_local * min(c + 1, WINDOW) for c in contexts)
        assert decode.kv_read() == pytest.approx(brute / model.num_layers, rel=1e-12, abs=1e-9)
        checked["iterations"] += 1

    scenario = make_scenario({"model": {"base": "Mistral-7B-v0.1", "sliding_window_layers": 16},
                              "engine": {"memory_utilization": 0.3}, "simulation": {"horizon": "2000 s"},
                              "workload": {"arrival": {"rate": 4.0}, "num_requests": 60,
                                           "prompt_tokens": {"distribution": "uniform", "low": 3000, "high": 5000},
                                           "output_tokens": {"distribution": "uniform", "low": 200, "high": 1500}}})
    assert scenario.model.local_attention_share == 0.5
    result = simulate_checked(scenario, observers=[recount])
    assert checked["iterations"] == len(result.iterations) and (result.requests["status"] == "finished").all()


def test_bad_sliding_window_layers_exit_2(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text((REPO / "scenarios" / "llama3-8b-h100-chat.yaml").read_text().replace(
        "model: Llama-3.1-8B", "model: {base: Mistral-7B-v0.1, sliding_window_layers: 40}"))
    assert "model: {base: Mistral-7B-v0.1" in path.read_text()
    assert main(["run", str(path)]) == 2
    error = capsys.readouterr().err
    assert "s.yaml" in error and "model.sliding_window_layers" in error and "40" in error and "0..32" in error
