"""Whole-step terms beside the layers' operators (the KV-cache write, sampling) and the engine's CPU work per step
with and without asynchronous scheduling, each against its closed form."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llmsim import CostModel, lookup_hardware, model_catalog, simulate
from llmsim.catalog.kernel_terms import EngineKernels, StreamFusion
from llmsim.cost.kernels import ELEMENTWISE_COUNTS, all_reduce_time_s, custom_all_reduce_time_s
from llmsim.cost.work import SAMPLING_BYTES_PER_VOCAB_ENTRY

from tests.helpers import make_scenario

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


def async_pair(rate: float, num_requests: int):
    """The same requests served with and without vLLM's asynchronous scheduling (the default H100 engine)."""
    runs = []
    for overlap in (False, True):
        scenario = make_scenario({"engine": {"async_scheduling": overlap},
                                  "workload": {"arrival": {"rate": rate}, "num_requests": num_requests},
                                  "simulation": {"warmup": 0}})
        runs.append(simulate(scenario).iterations)
    return scenario, runs


def host_s(scenario, sampled):
    """The CPU part of a step from the profile's figures: per step, plus per sampled sequence."""
    hw = scenario.hardware
    return hw.per_step_overhead_s + hw.kernels.step_overhead_per_sequence_s * sampled


def test_async_scheduling_hides_the_cpu_part_of_every_step_but_the_first_offline():
    """Offline (every request waiting at once) the batches do not depend on the step times, so both runs
    make the same batches; with the CPU work overlapped each step after the first takes the longer of its
    GPU part (the synchronous step less its CPU part) and its CPU part, and the first pays both."""
    scenario, (sync, overlapped) = async_pair(1e9, 300)
    same = ["decode_seqs", "prefill_tokens", "tokens_out"]
    assert (sync[same].to_numpy() == overlapped[same].to_numpy()).all()
    host = host_s(scenario, sync["tokens_out"].to_numpy())
    expected = np.maximum(sync["duration_s"].to_numpy() - host, host)
    expected[0] = sync["duration_s"].iloc[0]
    assert np.allclose(overlapped["duration_s"].to_numpy(), expected, rtol=1e-12)
    # The run is shorter by the CPU time it hid, and by no more.
    saved = sync["duration_s"].sum() - overlapped["duration_s"].sum()
    assert 0 < saved <= host[1:].sum() * (1 + 1e-12)


def test_a_step_after_the_engine_idled_pays_its_cpu_part_in_full():
    """Online, requests far apart: each arrives to an idle engine, whose first step has nothing to hide its
    CPU work behind (the scheduling gap); every later step of the request follows one at once and overlaps."""
    scenario, (sync, overlapped) = async_pair(0.02, 20)
    same = ["decode_seqs", "prefill_tokens", "tokens_out"]
    assert (sync[same].to_numpy() == overlapped[same].to_numpy()).all()       # each request alone
    after_idle = np.r_[True, overlapped["start_s"].to_numpy()[1:] > overlapped["end_s"].to_numpy()[:-1]]
    assert after_idle.sum() == 20 and (overlapped.loc[after_idle, "prefill_tokens"] > 0).all()
    assert np.allclose(overlapped.loc[after_idle, "duration_s"], sync.loc[after_idle, "duration_s"], rtol=1e-12)
    host = host_s(scenario, sync.loc[~after_idle, "tokens_out"].to_numpy())
    gpu = sync.loc[~after_idle, "duration_s"].to_numpy() - host
    assert np.allclose(overlapped.loc[~after_idle, "duration_s"], np.maximum(gpu, host), rtol=1e-12)


def test_vllms_async_scheduling_flag_turns_the_overlap_on():
    assert not make_scenario().engine.async_scheduling
    scenario = make_scenario({"engine": {"vllm_args": "vllm serve meta-llama/Llama-3.1-8B --async-scheduling"}})
    assert scenario.engine.async_scheduling and scenario.vllm_notes == ()


def streaming_closed_form(model, kernels, tokens: int, kernel_bytes: dict[str, float]) -> float:
    """One step's streaming time over every layer: per kernel kind, its count x (floor + tokens x bytes / bandwidth
    + one row's bytes / row bandwidth), the profile's figures, for the kinds in ``kernel_bytes`` (bytes per token)."""
    return model.num_layers * sum(
        ELEMENTWISE_COUNTS[kind] * (kernels.elementwise[kind].floor_s
                                    + tokens * size / kernels.elementwise[kind].bandwidth_bytes_per_s
                                    + size / kernels.elementwise[kind].row_bandwidth_bytes_per_s)
        for kind, size in kernel_bytes.items())


def test_tensorrt_llm_fuses_rope_into_attention_and_the_residual_add_into_the_norm():
    """TensorRT-LLM applies the rotary embedding inside its attention op and calls each RMSNorm with the residual
    (one add-norm kernel: the layer input and the residual in, their sum and the normed sum out, 4 hidden-wide
    rows of 16-bit values per token); vLLM's kernel terms run the norm (2 rows), the residual add (3 rows), SiLU
    (gate and up in, one out) and rotary (q and k, read and written) as kernels of their own."""
    h200 = lookup_hardware("H200")
    tokens = 4096
    x = CostModel(MODEL, h200).features([tokens], [0], [], prefill_logits=0)
    row_bytes = MODEL.hidden_size * 2
    silu = 3 * MODEL.intermediate_size * 2
    rotary = 2 * (MODEL.num_heads + MODEL.num_kv_heads) * MODEL.head_dim * 2
    expected = {"vllm": {"norm": 2 * row_bytes, "residual": 3 * row_bytes, "activation": silu, "rotary": rotary},
                "trtllm": {"norm": 4 * row_bytes, "activation": silu}}
    for engine, kernel_bytes in expected.items():
        hardware = h200.for_engine(EngineKernels(engine))
        row = CostModel(MODEL, hardware).breakdown(x).set_index("operator").loc["layer.elementwise"]
        assert row["time_s"] == pytest.approx(streaming_closed_form(MODEL, hardware.kernels, tokens, kernel_bytes),
                                              rel=1e-9), engine


def test_tensorrt_llm_runs_a_wide_models_add_norms_inside_its_all_reduces():
    """With tensor parallelism TensorRT-LLM runs Llama's residual add and RMSNorm inside the all-reduce before
    them, for models wider than 4,096 (modeling_llama.py: ``enable_fusion &= config.hidden_size > 4096``): a 70B
    at TP 2 streams only SiLU over its half of the intermediate columns and pays the same all-reduces as without
    the fusion; an 8B at TP 2 keeps its add-norms; at TP 1 (no all-reduce) the 70B keeps them too."""
    h200 = lookup_hardware("H200").for_engine(EngineKernels.TRTLLM)
    wide = model_catalog()["Llama-3.1-70B"]
    tokens = 512                                # an 8 MB all-reduce: within the engine's 16 MB workspace at TP 2

    def streaming_and_rest(model, tp):
        cost = CostModel(model, h200, tp)
        rows = cost.breakdown(cost.features([tokens], [0], [], prefill_logits=0)).set_index("operator")
        return rows.loc["layer.elementwise", "time_s"], rows.loc["overhead+communication", "time_s"]

    streaming, communication = streaming_and_rest(wide, 2)
    silu = {"activation": 3 * wide.intermediate_size / 2 * 2}
    assert streaming == pytest.approx(streaming_closed_form(wide, h200.kernels, tokens, silu), rel=1e-9)
    unfused = dataclasses.replace(h200, kernels=dataclasses.replace(h200.kernels, stream_fusion=StreamFusion()))
    cost = CostModel(wide, unfused, 2)
    rows = cost.breakdown(cost.features([tokens], [0], [], prefill_logits=0)).set_index("operator")
    assert communication == pytest.approx(rows.loc["overhead+communication", "time_s"], rel=1e-12)
    assert rows.loc["layer.elementwise", "time_s"] > streaming
    narrow_streaming, _ = streaming_and_rest(MODEL, 2)
    add_norm = {"norm": 4 * MODEL.hidden_size * 2, "activation": 3 * MODEL.intermediate_size / 2 * 2}
    assert narrow_streaming == pytest.approx(streaming_closed_form(MODEL, h200.kernels, tokens, add_norm), rel=1e-9)
    single, _ = streaming_and_rest(wide, 1)
    add_norm_wide = {"norm": 4 * wide.hidden_size * 2, "activation": 3 * wide.intermediate_size * 2}
    assert single == pytest.approx(streaming_closed_form(wide, h200.kernels, 1 * tokens, add_norm_wide), rel=1e-9)


def _switching_over_at(hardware, switch_over_bytes: float, at_most: bool = False):
    """``hardware`` with its custom all-reduce handing messages past ``switch_over_bytes`` to NCCL (``at_most``: past
    the lesser of that and its own switch-over size)."""
    switched = {count: dataclasses.replace(custom, switch_over_bytes=min(custom.switch_over_bytes, switch_over_bytes)
                                           if at_most else switch_over_bytes)
                for count, custom in hardware.kernels.custom_all_reduce.items()}
    return dataclasses.replace(hardware, kernels=dataclasses.replace(hardware.kernels, custom_all_reduce=switched))


@pytest.mark.parametrize("model_name, tp, workspace_bytes", [("Llama-3.1-70B", 2, 16e6), ("Llama-3.1-405B", 8, 8e6)])
def test_tensorrt_llm_runs_the_add_norm_after_an_all_reduce_that_outgrows_its_workspace(model_name, tp,
                                                                                       workspace_bytes):
    """TensorRT-LLM's all-reduce falls back to NCCL for a message larger than its custom kernels' workspace (16 MB
    for two GPUs, 8 MB for more: customAllReduceUtils.h ``getMaxRequiredWorkspaceSize``), "regardless of the fusion
    type" (allreduceOp.cpp), and runs the fused add-norm after it: from the first token count whose 16-bit hidden
    state outgrows the workspace, each of a layer's two all-reduces costs one add-norm kernel more (the closed form
    of the profile's norm kernel over 4 hidden-wide rows a token), and nothing below it."""
    h200 = lookup_hardware("H200").for_engine(EngineKernels.TRTLLM)
    model = model_catalog()[model_name]
    # The custom kernel's own switch to NCCL held at the workspace in both: past it, both run NCCL, and what differs
    # is the add-norm alone.
    h200 = _switching_over_at(h200, workspace_bytes, at_most=True)
    inside = dataclasses.replace(h200, kernels=dataclasses.replace(
        h200.kernels, stream_fusion=dataclasses.replace(h200.kernels.stream_fusion, pair_workspace_bytes=np.inf,
                                                        workspace_bytes=np.inf)))
    last_inside = int(workspace_bytes // (model.hidden_size * 2))

    def communication(hardware, tokens):
        cost = CostModel(model, hardware, tp)
        rows = cost.breakdown(cost.features([tokens], [0], [], prefill_logits=0)).set_index("operator")
        return rows.loc["overhead+communication", "time_s"], rows.loc["layer.elementwise", "time_s"]

    for tokens in (last_inside, last_inside + 1, 4 * last_inside):
        (comm, streaming), (comm_inside, streaming_inside) = communication(h200, tokens), communication(inside, tokens)
        assert streaming == pytest.approx(streaming_inside, rel=1e-12)
        add_norms = 0.0 if tokens == last_inside else streaming_closed_form(
            model, h200.kernels, tokens, {"norm": 4 * model.hidden_size * 2})
        assert comm - comm_inside == pytest.approx(add_norms, rel=1e-9, abs=1e-12), tokens


def _gemm_rows(hardware, model, tp: int, tokens: int) -> dict[str, float]:
    cost = CostModel(model, hardware, tp)
    rows = cost.breakdown(cost.features([tokens], [0], [], prefill_logits=0)).set_index("operator")
    return {op: rows.loc[op, "time_s"] for op in ("layer.qkv", "layer.out_proj", "layer.mlp",
                                                  "overhead+communication")}


def _without_fusion(hardware):
    return dataclasses.replace(hardware, kernels=dataclasses.replace(hardware.kernels, stream_fusion=StreamFusion()))


def test_tensorrt_llm_gemms_whose_input_arrives_in_8_bits_quantize_nothing():
    """With FP8 weights TensorRT-LLM's attention op writes its output in FP8 and its SwiGLU quantizes its own output
    (attention.py ``out_scale``, gated_mlp.py ``swiglu(..., quant_scale=...)``): the output and down projections run
    no quantization pass. Against the same terms without the engine's fusions, a step at TP 1 is cheaper by exactly
    those two passes (tokens x their input width x 3 bytes over the profile's quantization bandwidth, every layer),
    and the QKV and gate-up projections (fed by a 16-bit add-norm at TP 1) keep theirs."""
    h100 = lookup_hardware("H100-SXM").for_engine(EngineKernels.TRTLLM)
    model = model_catalog()["Llama-3.1-70B"].with_dtypes(weight_dtype="fp8")
    tokens = 2048
    fused, unfused = _gemm_rows(h100, model, 1, tokens), _gemm_rows(_without_fusion(h100), model, 1, tokens)
    per_pass = model.num_layers * tokens * 3.0 / h100.kernels.for_dtype("fp8").gemm_quantize_bandwidth_bytes_per_s
    assert unfused["layer.out_proj"] - fused["layer.out_proj"] == pytest.approx(per_pass * model.q_dim, rel=1e-9)
    assert unfused["layer.mlp"] - fused["layer.mlp"] == pytest.approx(per_pass * model.intermediate_size, rel=1e-9)
    assert fused["layer.qkv"] == pytest.approx(unfused["layer.qkv"], rel=1e-12)


@pytest.mark.parametrize("model_name, tp, workspace_bytes", [("Llama-3.1-70B", 2, 16e6), ("Llama-3.1-405B", 8, 8e6)])
def test_tensorrt_llm_quantizes_inside_the_all_reduce_and_after_its_nccl_fallback(model_name, tp, workspace_bytes):
    """TensorRT-LLM's Llama layers with FP8 weights run RESIDUAL_RMS_NORM_QUANT_FP8 in their all-reduces: the fused
    kernel writes the normed state in FP8, so the QKV and gate-up projections quantize nothing while the message fits
    the workspace; past it the all-reduce falls back to NCCL and ``fallbackRunSubsequentOps`` runs the add-norm and
    then ``symmetric_static_quantize_per_tensor`` (allreduceOp.cpp). Each of a layer's two all-reduces then costs the
    add-norm and one quantization of the hidden state at the engine's measured quantizer (floor + 3 bytes an element
    over its bandwidth: the profile's ``quantize`` figures), and nothing more below the workspace."""
    h100 = _switching_over_at(lookup_hardware("H100-SXM").for_engine(EngineKernels.TRTLLM), workspace_bytes,
                              at_most=True)
    quantizer = h100.kernels.quantize
    assert quantizer is not None
    model = model_catalog()[model_name].with_dtypes(weight_dtype="fp8")
    inside = dataclasses.replace(h100, kernels=dataclasses.replace(
        h100.kernels, stream_fusion=dataclasses.replace(h100.kernels.stream_fusion, pair_workspace_bytes=np.inf,
                                                        workspace_bytes=np.inf)))
    last_inside = int(workspace_bytes // (model.hidden_size * 2))
    gemm_quantize = h100.kernels.for_dtype("fp8").gemm_quantize_bandwidth_bytes_per_s
    for tokens in (last_inside, last_inside + 1, 4 * last_inside):
        fused, no_fallback = _gemm_rows(h100, model, tp, tokens), _gemm_rows(inside, model, tp, tokens)
        unfused = _gemm_rows(_without_fusion(h100), model, tp, tokens)
        # The QKV projection's pass (the gate-up one is in layer.mlp with the down projection's) is gone.
        assert unfused["layer.qkv"] - fused["layer.qkv"] == pytest.approx(
            model.num_layers * tokens * model.hidden_size * 3.0 / gemm_quantize, rel=1e-9)
        after = 0.0 if tokens == last_inside else 2 * model.num_layers * (
            streaming_closed_form(model, h100.kernels, tokens, {"norm": 4 * model.hidden_size * 2}) / model.num_layers
            / ELEMENTWISE_COUNTS["norm"]
            + quantizer.floor_s + tokens * model.hidden_size * 3.0 / quantizer.bandwidth_bytes_per_s)
        assert fused["overhead+communication"] - no_fallback["overhead+communication"] == pytest.approx(
            after, rel=1e-9, abs=1e-12), tokens


def test_tensorrt_llm_all_reduces_past_its_workspace_run_on_nccl():
    """TensorRT-LLM sends an all-reduce larger than its custom kernels' workspace (8 MB on 4 GPUs) to NCCL whatever
    the two kernels' times (allreduceOp.cpp ``ifFallbackToNCCL``): on 4 H200s whose custom kernel would be chosen to
    64 MiB, a step whose hidden state is past 8 MB pays NCCL's all-reduce (the profile's alpha-beta lines), one within
    it the custom kernel's."""
    h200 = _switching_over_at(lookup_hardware("H200").for_engine(EngineKernels.TRTLLM), 64 * 2.0**20)
    model = model_catalog()["Llama-3.1-70B"]
    custom = h200.kernels.custom_all_reduce_for(4)
    assert custom is not None
    unfused = _without_fusion(h200)
    for tokens in (400, 1200):
        message = tokens * model.hidden_size * 2.0
        cost = CostModel(model, unfused, 4)
        x = cost.features([tokens], [0], [], prefill_logits=0)
        base = float(cost.fixed_vector @ x)
        communication = cost.breakdown(x).set_index("operator").loc["overhead+communication", "time_s"] - base
        engine_cost = CostModel(model, h200, 4)
        engine = engine_cost.breakdown(x).set_index("operator").loc["overhead+communication", "time_s"] - base
        nccl = all_reduce_time_s(message, 4, h200.kernels.all_reduce_for(4))
        own = custom_all_reduce_time_s(message, 4, custom)
        assert communication == pytest.approx(2 * model.num_layers * own, rel=1e-9)
        expected = own if message <= 8e6 else nccl
        assert engine - (0.0 if message <= 8e6 else 2 * model.num_layers * streaming_closed_form(
            model, h200.kernels, tokens, {"norm": 4 * model.hidden_size * 2}) / model.num_layers
            / ELEMENTWISE_COUNTS["norm"]) == pytest.approx(2 * model.num_layers * expected, rel=1e-9), tokens
