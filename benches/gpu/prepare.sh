#!/usr/bin/env bash
# Run on a CPU machine with Rust: builds what benches/gpu/run.sh installs on a GPU host that
# has PyTorch but no Rust and no network: the abi3 wheel and the test runner's wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf dist/gpu && mkdir -p dist/gpu
python3 -m maturin build --release --out dist/gpu
python3 -m pip download --only-binary=:all: --dest dist/gpu pytest pluggy iniconfig packaging
ls -la dist/gpu
