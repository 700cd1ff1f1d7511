#!/usr/bin/env bash
# Run here, on a machine with Rust and network: fills dist/gpu with everything
# benches/gpu/run.sh installs on a GPU host that has PyTorch and pytest but no Rust and no
# network, checks the run script on the CPU (optional), and prints the command to run there.
#
#     bash benches/gpu/prepare.sh            # build dist/gpu, print the device command
#     bash benches/gpu/prepare.sh --check    # the same, then the CPU dry run of run.sh on it
set -euo pipefail
cd "$(dirname "$0")/../.."
check=0
for a in "$@"; do
    case $a in
        --check) check=1 ;;
        *) echo "prepare.sh: unknown argument $a (expected --check)" >&2; exit 2 ;;
    esac
done
dest=dist/gpu
rm -rf "$dest" && mkdir -p "$dest"

echo "== spillover wheel (abi3: any CPython >= 3.9, any torch and CUDA version)"
python3 -m maturin build --release --out "$dest"

echo "== the test runner and spillover's light dependencies"
# run.sh installs each of these only where the GPU host lacks it. numpy's wheel is for this
# machine's Python version; pytest and friends are pure Python, psutil is abi3.
python3 -m pip download -q --only-binary=:all: --dest "$dest" \
    pytest pytest-timeout psutil numpy

# Which tree the wheel was built from, so run.sh can say whether the tests match it.
{
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "dirty $( (git status --porcelain --untracked-files=no -- rust python Cargo.toml pyproject.toml 2>/dev/null || echo '?') | wc -l)"
    echo "built $(date -u +%FT%TZ) on $(hostname) with $(python3 --version 2>&1)"
} > "$dest/BUILD_INFO"
ls -la "$dest"
size=$(du -sm "$dest" | cut -f1)
echo "dist/gpu: ${size} MiB (the device tool carries at most 64 MiB)"
if [ "$size" -ge 60 ]; then
    echo "prepare.sh: dist/gpu is too large to carry" >&2
    exit 1
fi
bash -n benches/gpu/run.sh

if [ "$check" = 1 ]; then
    echo "== CPU dry run of run.sh on these wheels"
    OUT=$(mktemp -d) bash benches/gpu/run.sh --dry-run
fi

cat <<EOF

== ready. On the GPU host, from the repository root (a copy of this working tree), run

    OUT=\$OUT bash benches/gpu/run.sh            # everything, under 7 minutes on an H200
    OUT=\$OUT bash benches/gpu/run.sh --quick    # parity, memory probes, one benchmark pair: < 3 min

with dist/gpu carried along (it is git-ignored): device tool run(command=..., carry=["dist/gpu"],
timeout_s=480 for the full run, 240 for --quick). Results: \$OUT/summary.md (written step by
step), \$OUT/run.log, \$OUT/bench/*.json, \$OUT/tests-*.xml.
EOF
