#!/usr/bin/env bash
# One-shot calibration of an NVIDIA H200, for a session that has one.
#
#   bash benchmarks/calibrate_h200.sh [OUT_DIR]        (default OUT_DIR: $OUT, else benchmarks/h200-calibration)
#
# Needs a Python with a CUDA build of torch and llmsim's dependencies (numpy, scipy, pandas, pyyaml,
# simpy, tqdm, matplotlib); it downloads nothing. PYTHON picks the interpreter (default: .venv/bin/python
# if present, else python3); QUICK=1 runs the quick grids (for a short device lease).
# Writes to OUT_DIR: env.txt (torch, CUDA, nvidia-smi), h200-calibrated.yaml (the profile, with the full
# measurement record), calibrate.txt (roofline, KV layouts, fit) and validate.txt + validate.png (held-out
# steps re-measured: calibrated vs uncalibrated roofline MAPE and worst error). Ship the profile as
# hardware_profiles/h200-calibrated.yaml only together with its validate.txt figures in the README.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-benchmarks/h200-calibration}}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
QUICK_FLAG=${QUICK:+--quick}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import importlib.util, sys
missing = [m for m in ("torch", "numpy", "scipy", "pandas", "yaml", "simpy", "tqdm", "matplotlib")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"calibrate_h200: missing Python packages: {', '.join(missing)} (set PYTHON to one that has them)")
import torch
if not torch.cuda.is_available():
    sys.exit(f"calibrate_h200: torch {torch.__version__} sees no CUDA device (a CPU-only build, or no GPU)")
name = torch.cuda.get_device_name(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device 0: {name}")
if "H200" not in name:
    print(f"calibrate_h200: warning: device 0 is {name}, not an H200; the profile describes what was measured")
EOF
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv \
    2>&1 | tee -a "$OUT_DIR/env.txt" || true

"$PYTHON" -m llmsim.cli.main calibrate --device cuda $QUICK_FLAG --out "$OUT_DIR/h200-calibrated.yaml" \
    | tee "$OUT_DIR/calibrate.txt"
"$PYTHON" -m llmsim.cli.main validate "$OUT_DIR/h200-calibrated.yaml" $QUICK_FLAG --plot "$OUT_DIR/validate.png" \
    | tee "$OUT_DIR/validate.txt"
