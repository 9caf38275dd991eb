"""How fast the production trace readers parse large files.

Writes synthetic files of ``N`` requests (default 1,000,000, about the size of one day of the
Azure 2024 conversation trace) in the Azure, BurstGPT and Mooncake formats to a temporary
folder, and prints the seconds each reader takes and requests per second; a second read of
the same file comes from the cache (plans rebuild the scenario at every probe). Run
``python benchmarks/bench_traces.py [N]``.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from llmsim.config.reader import Node
from llmsim.workload.trace_formats import read_trace


def write_files(folder: Path, n: int) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    offsets = np.cumsum(rng.exponential(0.08, n))
    prompt = np.maximum(1, rng.lognormal(7, 1, n).astype(int))
    output = np.maximum(1, rng.lognormal(5, 1, n).astype(int))
    stamps = (pd.Timestamp("2024-05-10", tz="UTC") + pd.to_timedelta(offsets, unit="s")).strftime(
        "%Y-%m-%d %H:%M:%S.%f+00:00")
    files = {"azure": folder / "azure.csv", "burstgpt": folder / "burstgpt.csv", "mooncake": folder / "mooncake.jsonl"}
    pd.DataFrame({"TIMESTAMP": stamps, "ContextTokens": prompt, "GeneratedTokens": output}).to_csv(
        files["azure"], index=False)
    pd.DataFrame({"Timestamp": np.round(offsets, 3), "Model": "ChatGPT", "Request tokens": prompt,
                  "Response tokens": output, "Total tokens": prompt + output, "Log Type": "Conversation log"}
                 ).to_csv(files["burstgpt"], index=False)
    with open(files["mooncake"], "w") as out:
        for t, p, o in zip(np.round(offsets * 1000).astype(int), prompt, output):
            out.write(json.dumps({"timestamp": int(t), "input_length": int(p), "output_length": int(o),
                                  "hash_ids": list(range(int(p) // 512 + 1))}) + "\n")
    return files


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), n)
        print(f"{n:,} requests per file")
        print(f"{'format':10s} {'MB':>7s} {'read s':>8s} {'requests/s':>12s} {'cached s':>9s}")
        for fmt, path in files.items():
            start = time.perf_counter()
            trace = read_trace(path, Node({}), "path", fmt)
            first = time.perf_counter() - start
            start = time.perf_counter()
            read_trace(path, Node({}), "path", fmt)
            again = time.perf_counter() - start
            assert len(trace) == n
            print(f"{fmt:10s} {path.stat().st_size / 1e6:7.1f} {first:8.2f} {n / first:12,.0f} {again:9.2f}")


if __name__ == "__main__":
    main()
