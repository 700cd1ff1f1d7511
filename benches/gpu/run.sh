#!/usr/bin/env bash
# One command on a GPU host (PyTorch present, no Rust, no network), after
# benches/gpu/prepare.sh filled dist/gpu on a CPU machine:
#     OUT=/some/folder bash benches/gpu/run.sh
# Installs the wheel (--no-deps), runs the gpu-marked tests, the Llama-style
# benchmark, the optimizer's GPU step and the GPU demo, and writes every
# log and result under $OUT (default ./gpu-out). Budget: under 8 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
echo "== $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.csv"
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
python3 -m pip install --no-index --find-links dist/gpu --no-deps --force-reinstall dist/gpu/spillover-*.whl
python3 -m pip install --no-index --find-links dist/gpu pytest 2>/dev/null || true
status=0
echo "== gpu tests"
timeout 120 python3 -m pytest tests/python -m gpu -q -p no:cacheprovider \
    --junitxml="$OUT/gpu-tests.xml" || status=1
echo "== Llama-style 1B benchmark (bf16, seq 4096)"
timeout 210 python3 benches/gpu/bench.py --out "$OUT" --nvme-path "${SPILLOVER_NVME_PATH:-/tmp}" || status=1
echo "== OffloadAdamW train step vs torch AdamW on the GPU (and torchao if installed)"
timeout 60 python3 benches/python/optim_bench.py --parts gpu --rounds 6 | tee "$OUT/optim-gpu.md" \
    || status=1
echo "== demo on the GPU"
timeout 90 python3 -m spillover demo --size medium --steps 4 --out "$OUT/demo" || status=1
echo "== exit $status"
exit $status
