#!/usr/bin/env bash
# Run here, on a machine with Rust and network: fills dist/gpu with everything
# benches/gpu/run.sh installs on a GPU host that has PyTorch and pytest but no Rust and no
# network, checks the run script on the CPU (optional), and prints the command to run there.
#
#     bash benches/gpu/prepare.sh            # build dist/gpu, print the command for the GPU host
#     bash benches/gpu/prepare.sh --check    # the same, then the CPU dry run of run.sh on it
#
# Needs: a Rust toolchain (cargo), network (for pip), and either maturin importable by
# $PYTHON (default python3) or pip, which then builds the wheel as `pip install .` does: in an
# isolated environment that fetches maturin (pyproject.toml's build-system), so a machine where
# only `pip install .` was ever run works too.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
check=0
for a in "$@"; do
    case $a in
        --check) check=1 ;;
        *) echo "prepare.sh: unknown argument $a (expected --check)" >&2; exit 2 ;;
    esac
done
if ! command -v cargo >/dev/null; then
    echo "prepare.sh: cargo not found: building the wheel needs a Rust toolchain (https://rustup.rs)" >&2
    exit 2
fi
dest=dist/gpu
rm -rf "$dest" && mkdir -p "$dest"

echo "== spillover wheel (abi3: any CPython >= 3.9, any torch and CUDA version)"
if "$PY" -m maturin --version >/dev/null 2>&1; then
    "$PY" -m maturin build --release --out "$dest"
else
    # The same build `pip install .` makes (maturin's PEP 517 backend builds in release mode),
    # with maturin fetched into pip's isolated build environment, not installed here.
    echo "(maturin is not importable by $PY: building through pip, whose isolated build fetches it)"
    "$PY" -m pip wheel --no-deps --wheel-dir "$dest" .
fi
wheels=$(find "$dest" -maxdepth 1 -name 'spillover-*.whl' | wc -l)
if [ "$wheels" != 1 ]; then
    echo "prepare.sh: expected one spillover wheel in $dest, found $wheels" >&2
    exit 1
fi

echo "== the test runner and spillover's light dependencies"
# run.sh installs each of these only where the GPU host lacks it. numpy's wheel is for this
# machine's Python version; pytest and friends are pure Python, psutil is abi3.
"$PY" -m pip download -q --only-binary=:all: --dest "$dest" \
    pytest pytest-timeout psutil numpy

# Which tree the wheel was built from, so run.sh can say whether the tests match it.
{
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "dirty $( (git status --porcelain --untracked-files=no -- rust python Cargo.toml pyproject.toml 2>/dev/null || echo '?') | wc -l)"
    echo "built $(date -u +%FT%TZ) on $(hostname) with $("$PY" --version 2>&1)"
} > "$dest/BUILD_INFO"
ls -la "$dest"
size=$(du -sm "$dest" | cut -f1)
echo "dist/gpu: ${size} MiB"
if [ "$size" -ge 60 ]; then  # it travels with the working tree to the GPU host: keep it small
    echo "prepare.sh: dist/gpu is ${size} MiB, more than the 60 MiB it may take" >&2
    exit 1
fi
bash -n benches/gpu/run.sh

if [ "$check" = 1 ]; then
    echo "== CPU dry run of run.sh on these wheels"
    OUT=$(mktemp -d) PYTHON=$PY bash benches/gpu/run.sh --dry-run
fi

cat <<EOF

== ready. Copy dist/gpu (git-ignored) along with the repository to the GPU host, and there,
from the repository root, run one of

    OUT=gpu-out bash benches/gpu/run.sh            # everything, under 7.5 minutes on an H200
    OUT=gpu-out bash benches/gpu/run.sh --quick    # parity, memory probes, the three answers: < 3 min

Give the command a limit with some slack: about 8 minutes for the full run, 4 for --quick.
Results: gpu-out/summary.md (written step by step), gpu-out/run.log, gpu-out/bench/*.json,
gpu-out/tests-*.xml.
EOF
