#!/usr/bin/env bash
# One device lease: time one layer's operators and the attention kernels on an NVIDIA GPU,
# then (time allowing) the torch decode-step calibration.
#
#   bash benchmarks/profile_operators_h200.sh [OUT_DIR]     (default OUT_DIR: $OUT, else benchmarks/h200-operators)
#
# Needs a Python with a CUDA build of torch and llmsim's dependencies; downloads nothing. PYTHON picks the
# interpreter (default python3). OPS_TIMEOUT / STEP_TIMEOUT bound the two phases in seconds (defaults 330 / 150);
# rows are written as they are taken, so a phase cut short keeps what it finished.
# Writes OUT_DIR/ops/{tag}_linear_ops_ms_per_layer.csv, {tag}_attention.csv, {tag}_operators.json,
# OUT_DIR/run.log, and OUT_DIR/step/{h200-calibrated.yaml, calibrate.txt, validate.txt}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-benchmarks/h200-operators}}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT_DIR/ops" "$OUT_DIR/step"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee "$OUT_DIR/run.log") 2>&1
date -u
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv || true
"$PYTHON" -c "import torch, sys; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0)); sys.exit(0 if torch.cuda.is_available() else 1)" || exit 1
SECONDS=0
timeout "${OPS_TIMEOUT:-330}" "$PYTHON" -m llmsim.cli.main calibrate --device cuda --operators "$OUT_DIR/ops"
echo "operators: exit $? after ${SECONDS}s"
SECONDS=0
timeout "${STEP_TIMEOUT:-150}" "$PYTHON" -m llmsim.cli.main calibrate --device cuda --quick --out "$OUT_DIR/step/h200-calibrated.yaml" > "$OUT_DIR/step/calibrate.txt" 2>&1
echo "decode-step calibration: exit $? after ${SECONDS}s"
if [ -f "$OUT_DIR/step/h200-calibrated.yaml" ]; then
    timeout 60 "$PYTHON" -m llmsim.cli.main validate "$OUT_DIR/step/h200-calibrated.yaml" --quick > "$OUT_DIR/step/validate.txt" 2>&1
    echo "validate: exit $?"
fi
tail -5 "$OUT_DIR/step/calibrate.txt" "$OUT_DIR/step/validate.txt" 2>/dev/null
date -u
