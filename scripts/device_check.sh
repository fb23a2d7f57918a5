#!/usr/bin/env bash
# The GPU checks (issue 38) in one device call of about 9 minutes, for a session lent a GPU:
#
#   1. pytest -m gpu tests/unit/gpu_path: the device sampler on CUDA (a process of its own:
#      that directory switches Triton's interpreter on);
#   2. pdserve bench gpu (P10, at most 8 minutes): it runs pytest -m gpu tests/gpu first (the
#      compiled Triton kernels, captured against eager steps, the engine on CUDA with the graphs
#      on and off against transformers, the cuda_ipc hand-off, workers), then P6 --quick, the
#      roofline, attention alone, the hand-off and a profile; its keys against their targets
#      are printed and written to bench/results/gpu.json.
#
# Run from anywhere: scripts/device_check.sh. PYTHON picks the interpreter (default: the repo's
# .venv, else python3); it needs a CUDA build of torch and Triton. Logs and results go to
# bench/results/, and are copied to $OUT where the device runner sets it.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p bench/results
status=0

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "device_check: torch.cuda.is_available() is False for $PY: no GPU, or a CPU build of torch" >&2
    exit 2
fi
nvidia-smi -L 2>/dev/null || true

echo "== 1/2 pytest -m gpu tests/unit/gpu_path"
timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/unit/gpu_path \
    >bench/results/device-check-unit.log 2>&1 || status=1
tail -n 5 bench/results/device-check-unit.log

echo "== 2/2 pdserve bench gpu"
timeout 500 "$PY" -m cluster.cli bench gpu >bench/results/device-check-bench.log 2>&1 || status=1
grep -E "^\[gpu|target|^RESULT|Error|error" bench/results/device-check-bench.log | tail -n 60

if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    cp -r bench/results "$OUT/" 2>/dev/null || true
fi
exit $status
