"""The roofline cost of one engine iteration, and how memory is split between weights and KV.

An iteration runs every operator of every layer once over the whole batch
(prefill chunks and decode tokens together, as in vLLM or SGLang). Each operator
takes ``max(FLOPs / effective peak, bytes / effective bandwidth)``: weights are
read once per iteration, each sequence's KV cache once per layer. Tensor
parallelism splits weights, heads and FLOPs over ``tp`` devices and adds two
all-reduces of the hidden state per layer; pipeline parallelism runs the layers
as ``pp`` stages in sequence with an activation hop between stages. Fixed
per-step and per-layer overheads stand for scheduling, sampling and launches.

The model knows nothing of SimPy: :meth:`CostModel.iteration` takes batch
feature vectors (see :mod:`llmsim.cost.features`) and works on one vector or a
whole array of them at once.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from llmsim.catalog.hardware import HardwareProfile
from llmsim.catalog.models import ModelSpec
from llmsim.cost.features import F, FEATURES, batch_features
from llmsim.cost.work import ATTENTION_OPS, BYTE_KINDS, LAYER_OPS, MODEL_OPS, work_coefficients
from llmsim.catalog.placement import Placement


class CostModel:
    """Iteration time, FLOPs and bytes of a model on ``tp x pp`` devices of one profile."""

    def __init__(self, model: ModelSpec, hardware: HardwareProfile,
                 tensor_parallel: int = 1, pipeline_parallel: int = 1, placement: Placement | None = None):
        self.model, self.hardware = model, hardware
        self.tp, self.pp = tensor_parallel, pipeline_parallel
        self.num_devices = tensor_parallel * pipeline_parallel
        coeffs = work_coefficients(model, tensor_parallel)
        # Stack layer operators (run once per layer) and model operators (once). The work is that
        # of every layer; the time is paced by the slowest of pp stages, ceil(layers / pp) layers,
        # since a micro-batch comes round again only after it has served all pp of them.
        self.op_names = tuple(f"layer.{op}" for op in LAYER_OPS) + MODEL_OPS
        paced_layers = pipeline_parallel * -(-model.num_layers // pipeline_parallel)
        repeat = np.array([model.num_layers] * len(LAYER_OPS) + [1] * len(MODEL_OPS), dtype=float)[:, None]
        pace = np.array([paced_layers / model.num_layers] * len(LAYER_OPS) + [1] * len(MODEL_OPS))[:, None]
        self.placement = placement
        tiers = hardware.tiers
        weight_tier = placement.weight_tier if placement else tiers[0]
        kv_tier = placement.kv_tier if placement else tiers[0]
        # Seconds per byte of each kind, from the tier it lives in; attention kernels move more
        # than the KV bytes they need when they gather paged blocks.
        compute_efficiency, attention_efficiency, efficiency = hardware.efficiencies_for(model.weight_dtype)
        seconds_per_byte = {"weights": 1.0 / (weight_tier.bandwidth_bytes_per_s * efficiency),
                            "kv": hardware.kv_read_penalty / (kv_tier.bandwidth_bytes_per_s * efficiency),
                            "activations": 1.0 / (tiers[0].bandwidth_bytes_per_s * efficiency)}
        self.flops_matrix = np.vstack([coeffs.layer_flops, coeffs.model_flops]) * repeat
        self.bytes_matrix = sum(np.vstack([coeffs.layer_bytes[kind], coeffs.model_bytes[kind]])
                                for kind in BYTE_KINDS) * repeat
        memory_time = sum(np.vstack([coeffs.layer_bytes[kind], coeffs.model_bytes[kind]]) * seconds_per_byte[kind]
                          for kind in BYTE_KINDS) * repeat * pace
        gemm_peak = hardware.peak_for(model.weight_dtype) * compute_efficiency
        attention_peak = hardware.peak_for("bf16") * attention_efficiency
        self.seconds_per_flop = np.array(
            [1.0 / (attention_peak if op in ATTENTION_OPS else gemm_peak) for op in LAYER_OPS]
            + [1.0 / gemm_peak] * len(MODEL_OPS))
        self.fixed_vector = self._fixed_and_communication_vector()
        # One matrix turns a feature vector into everything an iteration needs: per-operator
        # compute time, per-operator memory time, fixed time, total FLOPs, total bytes.
        self._n_ops = len(self.op_names)
        self._memory_time = memory_time
        self._compute_time = self.flops_matrix * self.seconds_per_flop[:, None] * pace
        # Decode attention over context c runs at attention_efficiency * c / (c + half): as if each
        # sequence attended to `half` more tokens (time only; the FLOPs stay those of the work).
        decode = LAYER_OPS.index("attention_decode")
        self._compute_time[decode, F["decode_seqs"]] += (self._compute_time[decode, F["decode_kv_read"]]
                                                         * hardware.attention_half_context)
        self._stacked = np.vstack([self._compute_time,
                                   memory_time,
                                   self.fixed_vector,
                                   self.flops_matrix.sum(axis=0) * self.tp,
                                   self.bytes_matrix.sum(axis=0) * self.tp])

    def _fixed_and_communication_vector(self) -> np.ndarray:
        """Time that adds to the roofline: overheads, all-reduces and pipeline hops, per feature."""
        hw, model = self.hardware, self.model
        vector = np.zeros(len(FEATURES))
        vector[F["one"]] = hw.per_step_overhead_s + model.num_layers * hw.per_layer_overhead_s
        hidden_bytes = model.hidden_size * model.activation_bytes_per_element
        link = hw.interconnect_bandwidth_bytes_per_s * hw.interconnect_efficiency
        if self.tp > 1:
            # Ring all-reduce moves 2 (tp-1)/tp of the message over each link; two per layer.
            per_token = 2 * (self.tp - 1) / self.tp * hidden_bytes / link
            vector[F["one"]] += 2 * model.num_layers * hw.interconnect_latency_s
            vector[F["tokens"]] += 2 * model.num_layers * per_token
        if self.pp > 1:
            vector[F["one"]] += (self.pp - 1) * hw.interconnect_latency_s
            vector[F["tokens"]] += (self.pp - 1) * hidden_bytes / link
        return vector

    # -- the cost of a batch ------------------------------------------------------------------
    def features(self, prefill_new=(), prefill_context=(), decode_context=(), prefill_logits=None):
        """Feature vector of a batch; ``prefill_logits`` defaults to every chunk ending its prompt."""
        if prefill_logits is None:
            prefill_logits = len(prefill_new)
        return batch_features(prefill_new, prefill_context, decode_context, prefill_logits, self.model)

    def iteration(self, x):
        """(time_s, FLOPs, bytes) of iterations with feature vectors ``x`` (shape (9,) or (n, 9)).

        FLOPs and bytes are totals over all devices of the replica.
        """
        n = self._n_ops
        if type(x) is not np.ndarray:
            x = np.asarray(x, dtype=float)
        if x.ndim == 1:
            # The simulator's hot path: plain floats beat numpy reductions on 8 numbers.
            y = (self._stacked @ x).tolist()
            return sum(map(max, y[:n], y[n:2 * n])) + y[2 * n], y[2 * n + 1], y[2 * n + 2]
        y = x @ self._stacked.T
        time_s = np.maximum(y[..., :n], y[..., n:2 * n]).sum(axis=-1) + y[..., 2 * n]
        return time_s, y[..., 2 * n + 1], y[..., 2 * n + 2]

    def step_time(self, x) -> float:
        return float(self.iteration(x)[0])

    def breakdown(self, x) -> pd.DataFrame:
        """Per-operator FLOPs, bytes, time and bound for one batch (all layers, one shard)."""
        x = np.asarray(x, dtype=float)
        flops, moved = self.flops_matrix @ x, self.bytes_matrix @ x
        compute_s, memory_s = self._compute_time @ x, self._memory_time @ x
        rows = pd.DataFrame({"operator": self.op_names, "flops": flops, "bytes": moved,
                             "compute_s": compute_s, "memory_s": memory_s,
                             "time_s": np.maximum(compute_s, memory_s),
                             "bound": np.where(np.maximum(compute_s, memory_s) == 0, "none",
                                               np.where(compute_s >= memory_s, "compute", "memory"))})
        fixed = pd.DataFrame({"operator": ["overhead+communication"], "flops": [0.0], "bytes": [0.0],
                              "compute_s": [0.0], "memory_s": [0.0],
                              "time_s": [float(self.fixed_vector @ x)], "bound": ["fixed"]})
        return pd.concat([rows, fixed], ignore_index=True)

    # -- conveniences ---------------------------------------------------------------------------
    def prefill_time(self, tokens: int, context: int = 0) -> float:
        return self.step_time(self.features([tokens], [context], []))

    def decode_time(self, batch: int, context: int) -> float:
        return self.step_time(self.features([], [], [context] * batch))

    @property
    def peak_flops_per_s(self) -> float:
        """Replica peak for the model's GEMM dtype, for MFU."""
        return self.hardware.peak_for(self.model.weight_dtype) * self.num_devices

    @property
    def peak_bandwidth_bytes_per_s(self) -> float:
        return self.hardware.memory_bandwidth_bytes_per_s * self.num_devices
