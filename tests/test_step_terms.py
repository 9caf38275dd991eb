"""Whole-step terms beside the layers' operators: the KV-cache write and sampling, each against its closed form."""
from __future__ import annotations

import pytest

from llmsim import CostModel, lookup_hardware, model_catalog
from llmsim.cost.work import SAMPLING_BYTES_PER_VOCAB_ENTRY

MODEL = model_catalog()["Llama-3.1-8B"]


@pytest.mark.parametrize("hardware", ["H100-SXM", "H200", "A100-80GB"])
def test_the_kv_write_costs_the_bytes_written_over_the_bandwidth(hardware):
    """Every computed position (a prompt chunk's and each decoding sequence's) writes its K and V in every
    layer: tokens x layers x KV bytes per token per layer, at the KV tier's bandwidth, on top of attention."""
    hw = lookup_hardware(hardware)
    cost = CostModel(MODEL, hw)
    for chunk, decoding in ((512, 0), (0, 64), (2048, 256)):
        x = cost.features([chunk] if chunk else [], [1000] if chunk else [], [3000] * decoding, prefill_logits=0)
        written = (chunk + decoding) * MODEL.num_layers * MODEL.kv_bytes_per_token_per_layer
        seconds = written * hw.kv_read_penalty / (hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency)
        row = cost.breakdown(x).set_index("operator").loc["layer.kv_write"]
        assert row["time_s"] == pytest.approx(seconds, rel=1e-9) and row["bound"] == "memory"


def test_sampling_streams_the_vocabulary_once_per_pass_for_every_sampled_row():
    """Sampling is memory-bound work over the whole vocabulary per sampled row: rows x vocab x bytes per
    entry / bandwidth, linear in the rows, and the same on every rank of a tensor-parallel group."""
    hw = lookup_hardware("H100-SXM")
    for tp in (1, 4):
        cost = CostModel(MODEL, hw, tensor_parallel=tp)
        for rows in (1, 256):
            x = cost.features([], [], [500] * rows)
            seconds = rows * MODEL.vocab_size * SAMPLING_BYTES_PER_VOCAB_ENTRY / (
                hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency)
            assert cost.breakdown(x).set_index("operator").loc["sampling", "time_s"] == pytest.approx(seconds,
                                                                                                      rel=1e-9)
