"""vLLM's CUTLASS FP8 GEMM dispatch (``CutlassFP8ScaledMMLinearKernel``, per-tensor or per-token scales): which
kernel configuration each GEMM shape runs, and how many waves of output tiles it takes on a persistent kernel.

The configurations and the bands that choose them are vLLM's, read from its source:

- Hopper (SM90): ``csrc/quantization/w8a8/cutlass/c3x/scaled_mm_sm90_fp8_dispatch.cuh`` at vllm-project/vllm
  commit c30af8668c06a53ca6757f992f8bf9125e3fdd41 (``cutlass_gemm_sm90_fp8_dispatch``): M <= 16 and 16 < M <= 64
  swap A and B (the weight's N rows fill the tile's M side), each with a narrower cluster for N <= 1280; 64 < M <= 128
  runs 64 x 128 tiles; larger M 128 x 128 tiles, or 256 x 128 where M >= 8192 and K >= 6144.
- Blackwell (SM100, which B300's SM103 runs as well): ``csrc/quantization/w8a8/cutlass/c3x/
  scaled_mm_sm100_fp8_dispatch.cuh`` at commit 487e7b0e3e4cf2b65397e4069b20b0c099669d3b
  (``cutlass_gemm_sm100_fp8_dispatch``): M <= 16 and 16 < M <= 64 swap A and B (except M = 64 with K < 4096);
  64 < M <= 256 runs 128 x 128 tiles; larger M 256 x 128. Their schedule is ``KernelScheduleAuto``, with which
  CUTLASS's SM100 builder runs a cluster of even M as 2-SM kernels: each tile's MMA shared by a pair of SMs, each SM
  computing half its rows (CUTLASS ``include/cutlass/gemm/collective/builders/sm100_umma_builder.inl``).

A persistent CUTLASS kernel (``cutlass::gemm::PersistentScheduler`` on SM90) runs one cluster of thread blocks per
``cluster_m x cluster_n`` SMs at a time and walks the output's clusters of tiles in turns: a GEMM of ``C`` clusters on
``floor(SMs / cluster size)`` cluster slots takes ``ceil(C / slots)`` waves, each as long as one tile's K loop
(NVIDIA, *Matrix Multiplication Background User's Guide*, "tile quantization" and "wave quantization").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TileConfig:
    """One CUTLASS configuration: the tile (M x N x K, in the kernel's own operand order), the cluster of thread
    blocks (M x N), and whether the kernel swaps A and B (``swap_ab``: the GEMM runs as ``n x m``, the weight's rows
    on the tile's M side, so a handful of tokens fill the narrow N side)."""
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int
    cluster_n: int
    swap_ab: bool
    sms_per_tile: int = 1       # 2: an SM100 pair of SMs shares each tile's MMA (2-SM kernels)

    @property
    def sm_tile_m(self) -> float:
        """The rows of the tile one SM computes."""
        return self.tile_m / self.sms_per_tile


SM90 = {
    "m16_n1280": TileConfig(64, 16, 256, 1, 2, True),      # sm90_fp8_config_M16_N1280
    "m16": TileConfig(64, 16, 256, 1, 1, True),            # sm90_fp8_config_M16_N8192
    "m64_n1280": TileConfig(64, 16, 256, 1, 4, True),      # sm90_fp8_config_M64_N1280
    "m64": TileConfig(64, 64, 256, 1, 1, True),            # sm90_fp8_config_M64_N8192
    "m128": TileConfig(64, 128, 128, 2, 1, False),         # sm90_fp8_config_M128
    "default": TileConfig(128, 128, 128, 2, 1, False),     # sm90_fp8_config_default
    "m8192_k6144": TileConfig(256, 128, 128, 2, 1, False),  # sm90_fp8_config_M8192_K6144
}
SM100 = {
    "m16": TileConfig(128, 32, 128, 4, 1, True, 2),        # sm100_fp8_config_M16_swap_ab
    "m64_swap": TileConfig(128, 64, 256, 4, 1, True, 2),   # sm100_fp8_config_M64_swap_ab
    "m64": TileConfig(64, 64, 128, 1, 1, False),           # sm100_fp8_config_M64
    "m256": TileConfig(128, 128, 128, 2, 1, False, 2),     # sm100_fp8_config_M256
    "default": TileConfig(256, 128, 128, 2, 2, False, 2),  # sm100_fp8_config_default
}


def sm90_config(m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The SM90 configuration's name per GEMM (``cutlass_gemm_sm90_fp8_dispatch``)."""
    return np.select([m <= 16, m <= 64, m <= 128, (m >= 8192) & (k >= 6144)],
                     [np.where(n <= 1280, "m16_n1280", "m16"), np.where(n <= 1280, "m64_n1280", "m64"),
                      "m128", "m8192_k6144"], "default")


def sm100_config(m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The SM100 configuration's name per GEMM (``cutlass_gemm_sm100_fp8_dispatch``)."""
    return np.select([m <= 16, (m == 64) & (k < 4096), m <= 64, m <= 256], ["m16", "m64", "m64_swap", "m256"],
                     "default")


@dataclass(frozen=True)
class Dispatch:
    """One architecture's configurations and the function that picks one per GEMM shape."""
    configs: dict[str, TileConfig]
    choose: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


DISPATCH = {"hopper": Dispatch(SM90, sm90_config), "blackwell": Dispatch(SM100, sm100_config)}

# Streaming multiprocessors per GPU (the database's GPU names), with the source each profile cites and its confidence.
_B200_SMS = ("assumption: 148, the count CUDA reports for the B200 in published deviceQuery output (NVIDIA's datasheet "
             "gives none)")
SM_COUNT_SOURCES = {
    "H100-SXM": ("NVIDIA H100 Tensor Core GPU Architecture whitepaper (H100 SXM5: 132 SMs)", "datasheet"),
    "H200": ("assumption: 132, H100 SXM5's (the same GH100 configuration with HBM3e; NVIDIA's H200 datasheet gives no "
             "count)", "assumption"),
    "B200": (_B200_SMS, "assumption"),
    "GB200": (_B200_SMS + "; the GB200's Blackwell GPU taken as the B200's", "assumption"),
    "B300": ('NVIDIA technical blog "Inside NVIDIA Blackwell Ultra" (2025): 160 SMs', "datasheet"),
}
SM_COUNTS = {"H100-SXM": 132, "H200": 132, "B200": 148, "GB200": 148, "B300": 160}


def waves(config: TileConfig, m: np.ndarray, n: np.ndarray, sms: np.ndarray) -> np.ndarray:
    """Waves of ``config``'s clusters of output tiles over the GPU's cluster slots (persistent scheduling)."""
    rows, columns = (n, m) if config.swap_ab else (m, n)
    clusters = (np.ceil(np.ceil(rows / config.sm_tile_m) / config.cluster_m)
                * np.ceil(np.ceil(columns / config.tile_n) / config.cluster_n))
    slots = np.floor(sms / (config.cluster_m * config.cluster_n))
    return np.ceil(clusters / slots)

