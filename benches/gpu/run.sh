#!/usr/bin/env bash
# The GPU run in one command, on a GPU host with PyTorch and pytest (no Rust, no network), from
# the repository root, after benches/gpu/prepare.sh filled dist/gpu on a machine with Rust:
#
#     OUT=/some/folder bash benches/gpu/run.sh             # everything: under 7.5 minutes on an H200
#     OUT=/some/folder bash benches/gpu/run.sh --quick     # parity, memory probes, the three
#                                                          # answers: under 3 minutes
#     OUT=/some/folder bash benches/gpu/run.sh --dry-run   # every step on the CPU, tiny sizes
#
# Steps, each under a budget (seconds, printed) and all under one deadline:
#   install   the wheel and what is missing of numpy, psutil, pytest, pytest-timeout, from
#             dist/gpu into a private target (the environment is never written); stops the run at
#             once if the wheel does not install or `import spillover._native` fails
#   tests     tests/python/test_gpu_{step,pool,streams}.py, each test under a timeout (parity,
#             memory back at baseline, peaks, NVMe through a 64 MiB pool; pinned pool and link
#             speed, refused register; stream ordering)
#   sanitizer test_stream_gradients_bitwise[host] again under TORCH_CUDA_SANITIZER=1; full run only
#   bench     benches/gpu/bench.py, each mode in a process of its own; bench/bench-MODE.json is
#             written as the mode runs. Quick: none, full, host
#   answers   does the host tier lower the device peak, does backward keep it low, is the step
#             hidden: one ✓/✗ line each with its figures (benches/gpu/table.py answers)
#   optimizer benches/gpu/bench.py --mode optim: torch's fused AdamW against OffloadAdamW on a
#             GPT (device memory, time not hidden behind backward), then on the probe's 1B Llama
#             (bf16 parameters, fp32 masters on the host: bench/llama/); full run only
#   threads   benches/python/optim_threads.py: the Rust AdamW's GB/s at 1-16 threads against a
#             copy's on the device's host (issue 41: is the host update bandwidth-bound there?);
#             full run only
#   others    the gpu-marked tests of test_optim.py, test_optim_staged.py, test_optim_delayed.py,
#             then test_recompute.py and test_planner.py; full run only
# Everything lands under $OUT (default ./gpu-out): summary.md (each check ✓/✗ with its figure,
# appended the moment it is known), run.log, and results.tgz (tests-*.xml, bench/*.json, gpu.csv:
# one archive, made at the end or when the run stops). Exit status 0 when every
# step passed, 1 when one failed, 2 when the run could not start. (The answers are findings, not
# steps: a ✗ there does not change the exit status.)
set -uo pipefail  # not -e: one failed check must not stop the others (install stops the run itself)
cd "$(dirname "$0")/../.."
ROOT=$PWD
quick=0
dry=0
for a in "$@"; do
    case $a in
        --quick) quick=1 ;;
        --dry-run) dry=1 ;;
        -h | --help) sed -n '2,34p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown argument $a (expected --quick, --dry-run)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT/bench" || exit 2
OUT=$(cd "$OUT" && pwd)
if [ -z "${GPU_RUN_LOGGING:-}" ]; then  # everything also into run.log; exit once tee has it all
    GPU_RUN_LOGGING=1 OUT=$OUT bash "$ROOT/benches/gpu/run.sh" "$@" 2>&1 | tee "$OUT/run.log"
    exit "${PIPESTATUS[0]}"
fi
SUMMARY=$OUT/summary.md
: >"$SUMMARY"
rm -f "$OUT"/bench/*.json "$OUT"/tests-*.xml "$SUMMARY.current"

PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS, read once when cuBLAS starts
WORK=$(mktemp -d "${TMPDIR:-/tmp}/spillover-gpu.XXXXXX") || exit 2
SITE=$WORK/site
mkdir -p "$SITE"
# One archive of every result beside summary.md and run.log, also when the run stops early: a
# device run returns at most 8 files (bench/*.json, tests-*.xml and gpu.csv are about 15).
archive() {
    (cd "$OUT" && tar czf results.tgz --ignore-failed-read bench tests-*.xml gpu.csv 2>/dev/null)
    rm -rf "$OUT/bench" "$OUT"/tests-*.xml "$OUT/gpu.csv"
}
trap 'archive; rm -rf "$WORK"' EXIT
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# Budgets in seconds; DEADLINE caps the whole run (each step gets at most what is left, and
# `timeout -k 10` adds at most 10 s to the last): full 430 s, quick 170 s, so that with the
# header's few seconds the full run ends within 7.5 minutes and the quick one within 3.
TEST_K=()
if [ "$quick" = 1 ]; then
    run_kind="quick"
    B_INSTALL=20 B_TESTS=60 B_SANITIZER=0 B_OTHERS=0 B_OPTIM=0 B_OPTIM_LLAMA=0 B_PACK=0 B_THREADS=0
    DEADLINE=170 TEST_TIMEOUT=40
    BENCH_ARGS=(--steps 2)
    # host against none, with full checkpointing beside: the three answers need these three.
    BENCH_MODES=(none full host quickstart)
    declare -A B_BENCH=([none]=25 [full]=25 [host]=30 [quickstart]=30)
    TEST_K=(-k "not stream")  # the stream-ordering tests run in the full run
else
    run_kind="full"
    # 430 s: with the probe's 270 s first (benches/gpu/probe.py) and the machine's start, both
    # fit a 15-minute lease with room to run a failed step again
    B_INSTALL=20 B_TESTS=70 B_SANITIZER=15 B_OTHERS=30 B_OPTIM=25 B_OPTIM_LLAMA=30 B_PACK=20
    B_THREADS=30
    DEADLINE=430
    TEST_TIMEOUT=50
    BENCH_ARGS=(--steps 3)
    BENCH_MODES=(none full planned save_on_cpu host nvme auto quickstart quickstart-auto)
    # nvme moves about four times its pool through the disk each way per step: the largest.
    # quickstart: the README's Quick start whole (wrap, a new context every step, the
    # defaults), beside auto's one context; quickstart-auto: the same with policy="auto", no
    # budget
    declare -A B_BENCH=([none]=18 [full]=18 [planned]=28 [save_on_cpu]=18 [host]=22 [nvme]=30
                        [auto]=30 [quickstart]=30 [quickstart-auto]=25)
fi
if [ "$dry" = 1 ]; then  # the same steps on the CPU, at sizes that take seconds there
    export GPU_DRY_RUN=1 CUDA_VISIBLE_DEVICES=""
    run_kind="DRY RUN ($run_kind) on the CPU: tiny sizes, the figures are not GPU results"
    B_INSTALL=60 B_TESTS=150 DEADLINE=$((DEADLINE < 300 ? 240 : 450)) TEST_TIMEOUT=60
    ((B_SANITIZER > 0)) && B_SANITIZER=60
    ((B_OTHERS > 0)) && B_OTHERS=90
    ((B_OPTIM > 0)) && B_OPTIM=60
    ((B_OPTIM_LLAMA > 0)) && B_OPTIM_LLAMA=60
    ((B_PACK > 0)) && B_PACK=60
    ((B_THREADS > 0)) && B_THREADS=60
    BENCH_ARGS=(--tiny --device cpu --steps 2)
    for m in "${BENCH_MODES[@]}"; do B_BENCH[$m]=40; done
fi
DEADLINE=${GPU_RUN_DEADLINE:-$DEADLINE}  # to try the out-of-time paths
status=0

say() { printf '%s\n' "$@" | tee -a "$SUMMARY"; }
fail_now() {  # the run cannot go on: say why, plainly, and stop
    say "- ✗ $*" "" "**run stopped** after $SECONDS s: nothing else can run without this."
    exit 2
}
budget_left() {  # the step's budget, cut to what the deadline leaves
    local b=$1 left=$((DEADLINE - SECONDS))
    ((b > left)) && b=$left
    echo "$b"
}
section() {  # title budget -> 0 when the step may run
    if (($2 < 10)); then
        say "" "## $1 — – not run: out of time (deadline ${DEADLINE} s)"
        status=1
        return 1
    fi
    say "" "## $1 (budget $2 s, at ${SECONDS} s of ${DEADLINE})"
}
verdict() {  # rc seconds budget
    local rc=$1 dt=$2 budget=$3 where=""
    if [ "$rc" = 0 ]; then
        say "- step ✓ in ${dt} s"
        return
    fi
    status=1
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        [ -f "$SUMMARY.current" ] && where=" in \`$(cat "$SUMMARY.current")\`"
        say "- step ✗ timed out after ${dt} s (budget ${budget} s)${where}"
    else
        say "- step ✗ exit status $rc after ${dt} s"
    fi
    rm -f "$SUMMARY.current"
}

# ---- header ------------------------------------------------------------------------------------
say "# spillover GPU run: $run_kind" "" \
    "- started $(date -u +%FT%TZ) on $(hostname), deadline ${DEADLINE} s"
if [ "$dry" = 0 ]; then
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
            --format=csv,noheader >"$OUT/gpu.csv" 2>&1
        say "- GPU: $(head -1 "$OUT/gpu.csv") (name, memory, driver, PCIe gen and width: max, not the idle link's)"
    else
        say "- GPU: nvidia-smi not found"
    fi
fi
say "- python: $(timeout 60 "$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1), torch: $(timeout 60 "$PY" -c \
    'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())' 2>&1 | tail -1)"
if [ -f dist/gpu/BUILD_INFO ]; then
    built=$(awk '/^commit/ {print $2}' dist/gpu/BUILD_INFO)
    dirty=$(awk '/^dirty/ {print $2}' dist/gpu/BUILD_INFO)
    here=$(git rev-parse HEAD 2>/dev/null || echo "")
    if [ -z "$here" ]; then  # a copy of the working tree (the device machine's) has no .git
        say "- wheel built from $built (${dirty} uncommitted changes to rust/ and python/); this tree has no git to compare"
    else
        match="the same"
        [ "$built" != "$here" ] && match="NOT the same: the tests here may not match the wheel"
        say "- wheel built from $built (${dirty} uncommitted changes to rust/ and python/); this tree: $here ($match)"
    fi
fi
say "- memlock limit: $(ulimit -l); cores: $(nproc); $(awk '/^(MemTotal|MemAvailable):/ {printf "%s %.1f GiB ", $1, $2/1048576}' /proc/meminfo) (a microVM's grows as it is used)"

# Scratch for the NVMe tier: SPILLOVER_NVME_PATH if set, else a private dir under $TMPDIR.
if [ -z "${SPILLOVER_NVME_PATH:-}" ]; then
    mkdir -p "$WORK/swap"
    export SPILLOVER_NVME_PATH=$WORK/swap
fi
scratch=${SPILLOVER_NVME_PATH%%,*}
fs=$(df -PT "$scratch" 2>/dev/null | awk 'NR==2 {print $2 " on " $1 ", " int($5/1048576) " GiB free"}')
odirect=$("$PY" - "$scratch" <<'EOF' 2>&1
import mmap, os, sys
p = os.path.join(sys.argv[1], ".spillover-odirect-probe")
try:
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    try:
        os.write(fd, mmap.mmap(-1, 4096))  # page-aligned, as O_DIRECT wants
    finally:
        os.close(fd)
        os.unlink(p)
    print("ok")
except OSError as e:
    print(f"refused ({e.strerror})")
EOF
)
if [ "$odirect" = ok ]; then
    say "- NVMe scratch: $SPILLOVER_NVME_PATH ($fs); O_DIRECT ✓"
else
    export SPILLOVER_ALLOW_BUFFERED_IO=1
    say "- NVMe scratch: $SPILLOVER_NVME_PATH ($fs); O_DIRECT $odirect: SPILLOVER_ALLOW_BUFFERED_IO=1"
fi

# ---- install -----------------------------------------------------------------------------------
budget=$(budget_left $B_INSTALL)
section "install" "$budget"
t0=$SECONDS
pipi() { timeout -k 5 "$budget" "$PY" -m pip install -q --no-index --find-links "$ROOT/dist/gpu" --target "$SITE" "$@"; }
wheel=$(ls dist/gpu/spillover-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ]; then
    pipi --no-deps "$wheel" || fail_now "the wheel $wheel did not install (pip's message is in run.log)"
    say "- ✓ $(basename "$wheel") into a private target"
elif [ "$dry" = 1 ]; then
    say "- – no wheel in dist/gpu: the dry run uses the spillover installed here"
else
    fail_now "no wheel in dist/gpu: run \`bash benches/gpu/prepare.sh\` on a machine with Rust and copy dist/gpu here"
fi
for dep in numpy psutil; do
    if ! "$PY" -c "import $dep" 2>/dev/null; then
        pipi --no-deps "$dep" || fail_now "$dep is missing and dist/gpu's wheel of it did not install (built for another Python?)"
        say "- ✓ $dep from dist/gpu (it was missing)"
    fi
done
if ! "$PY" -c "import pytest" 2>/dev/null; then
    pipi pytest || fail_now "pytest is missing and did not install from dist/gpu"
    say "- ✓ pytest from dist/gpu (it was missing)"
fi
TIMEOUT_ARGS=()
if ! "$PY" -c "import pytest_timeout" 2>/dev/null; then
    if [ -f "$(ls dist/gpu/pytest_timeout-*.whl 2>/dev/null | head -1)" ]; then
        pipi --no-deps pytest-timeout || fail_now "pytest-timeout did not install from dist/gpu"
    fi
fi
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    TIMEOUT_ARGS=(--timeout="$TEST_TIMEOUT")
elif [ "$dry" = 1 ]; then
    say "- – pytest-timeout not available: no per-test timeout in this dry run (only the step's)"
else
    fail_now "pytest-timeout is neither installed nor in dist/gpu: rerun prepare.sh"
fi
native=$("$PY" -c 'import spillover._native, spillover; print(spillover.__version__, "from", spillover.__file__.rsplit("/", 2)[0])' 2>&1) ||
    fail_now "\`import spillover._native\` failed: $(echo "$native" | tail -1)"
say "- ✓ import spillover._native: spillover $native"
if [ "$dry" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    fail_now "torch sees no CUDA device (run with --dry-run on a machine without one)"
fi
say "- step ✓ in $((SECONDS - t0)) s"

# ---- tests -------------------------------------------------------------------------------------
pytest_step() {  # title budget name pytest-args...
    local title=$1 budget name=$3 t0 rc
    budget=$(budget_left "$2")
    shift 3
    section "$title" "$budget" || return 0
    t0=$SECONDS
    SUMMARY=$SUMMARY PYTHONPATH="$ROOT/benches/gpu:$PYTHONPATH" timeout -k 10 "$budget" \
        "$PY" -m pytest -q -p no:cacheprovider -p summary_plugin --continue-on-collection-errors \
        -o junit_family=xunit1 \
        "${TIMEOUT_ARGS[@]}" --junitxml="$OUT/tests-$name.xml" "$@"
    rc=$?
    verdict "$rc" $((SECONDS - t0)) "$budget"
}

# The test_gpu_*.py files are self-contained (--noconftest; what they share is
# tests/python/_gpu_common.py, which no other test file imports): a change to conftest.py cannot
# stop them. Quick's -k "not stream" leaves out every test of test_gpu_streams.py (the file's name
# matches) and test_backward_frees_what_it_brought_back_in_stream_order.
GPU_TESTS=(tests/python/test_gpu_step.py tests/python/test_gpu_pool.py
           tests/python/test_gpu_streams.py)
pytest_step "tests: test_gpu_{step,pool,streams}.py${TEST_K[1]:+ -k \"${TEST_K[1]}\"}" $B_TESTS gpu \
    "${GPU_TESTS[@]}" --noconftest "${TEST_K[@]}"

# TORCH_CUDA_SANITIZER checks that a kernel reading or writing a device tensor is ordered (by
# stream, event or synchronize) after the last kernel on another stream that wrote it (or read
# it, for a write). Of spillover's orderings it sees two: the copy stream waiting for the compute
# stream before a device->host copy reads its source, and the compute stream waiting for the
# host->device copy before it uses the tensor (Note [stream ordering] in rust/link/mod.rs). A race
# there may not show in one run's gradients; the sanitizer reports it whatever the timing.
# test_stream_gradients_bitwise[host] runs both, on the host tier. It is the only test run again:
# the sanitizer cannot help the others. Pool blocks are host memory, which it does not track; a
# free only forgets a pointer, with no check against work still pending on another stream, so
# the reuse races of Note [sources held] (rust/link/mod.rs) are invisible to it (the
# source test checks them by values); the nvme variant adds disk I/O on host blocks and nothing
# it can see; the synchronize test is about host waits, not ordering.
SANITIZER_K="test_stream_gradients_bitwise and host"
if [ "$B_SANITIZER" -gt 0 ]; then
    if [ "$dry" = 1 ]; then
        # The sanitizer needs a CUDA device; the dry run checks the step without it.
        pytest_step "sanitizer: test_gpu_streams.py -k \"$SANITIZER_K\" (dry run: TORCH_CUDA_SANITIZER needs CUDA, off)" \
            $B_SANITIZER sanitizer tests/python/test_gpu_streams.py --noconftest -k "$SANITIZER_K"
    else
        TORCH_CUDA_SANITIZER=1 pytest_step "sanitizer: test_gpu_streams.py -k \"$SANITIZER_K\" under TORCH_CUDA_SANITIZER=1" \
            $B_SANITIZER sanitizer tests/python/test_gpu_streams.py --noconftest -k "$SANITIZER_K"
    fi
fi

# ---- benchmark ---------------------------------------------------------------------------------
budgets=""
for m in "${BENCH_MODES[@]}"; do budgets+="${budgets:+, }$m ${B_BENCH[$m]} s"; done
say "" "## benchmark: Llama-style model, one process per mode, \`${BENCH_ARGS[*]}\` (budgets: $budgets)" ""
say "$("$PY" benches/gpu/table.py legend)"
if [ "$dry" = 1 ]; then
    say "" "Dry run: the memory columns are the CPU's stand-in (the process's peak RSS, reset per phase), not device memory."
fi
say ""
"$PY" benches/gpu/table.py header >>"$SUMMARY"
for m in "${BENCH_MODES[@]}"; do
    budget=$(budget_left "${B_BENCH[$m]}")
    if ((budget < 10)); then
        "$PY" benches/gpu/table.py failed-row "$m" "not run: out of time" --out "$OUT/bench" >>"$SUMMARY"
        status=1
        continue
    fi
    t0=$SECONDS
    timeout -k 10 "$budget" "$PY" benches/gpu/bench.py --mode "$m" --out "$OUT/bench" \
        --summary "$SUMMARY" "${BENCH_ARGS[@]}"
    rc=$?
    case $rc in
        0) ;;
        3) status=1 ;;  # the mode failed and wrote its own row
        124 | 137)
            status=1
            "$PY" benches/gpu/table.py failed-row "$m" "timed out after $((SECONDS - t0)) s (budget $budget s)" \
                --out "$OUT/bench" >>"$SUMMARY" ;;
        *)
            status=1
            "$PY" benches/gpu/table.py failed-row "$m" "exit status $rc" --out "$OUT/bench" >>"$SUMMARY" ;;
    esac
done

# ---- answers -----------------------------------------------------------------------------------
say "" "## answers (from none, full and host above)"
"$PY" benches/gpu/table.py answers --out "$OUT/bench" | tee -a "$SUMMARY"

# ---- optimizer ---------------------------------------------------------------------------------
if [ "$B_OPTIM" -gt 0 ]; then
    budget=$(budget_left $B_OPTIM)
    if section "optimizer: torch AdamW(fused) against OffloadAdamW(host), \`${BENCH_ARGS[*]}\`" "$budget"; then
        t0=$SECONDS
        timeout -k 10 "$budget" "$PY" benches/gpu/bench.py --mode optim --out "$OUT/bench" \
            --summary "$SUMMARY" --optim-budget "$budget" "${BENCH_ARGS[@]}"
        verdict $? $((SECONDS - t0)) "$budget"
    fi
fi
# the 1B Llama of the probe: bf16 parameters, fp32 masters on the host (issue 41's second model)
if [ "$B_OPTIM_LLAMA" -gt 0 ]; then
    budget=$(budget_left $B_OPTIM_LLAMA)
    if section "optimizer: the same on the 1B Llama (bf16 parameters), \`--optim-model llama ${BENCH_ARGS[*]}\`" "$budget"; then
        t0=$SECONDS
        timeout -k 10 "$budget" "$PY" benches/gpu/bench.py --mode optim --optim-model llama \
            --out "$OUT/bench/llama" --summary "$SUMMARY" --optim-budget "$budget" "${BENCH_ARGS[@]}"
        verdict $? $((SECONDS - t0)) "$budget"
    fi
fi

# ---- per-tensor cost of pack and unpack on the device --------------------------------------------
if [ "$B_PACK" -gt 0 ]; then
    budget=$(budget_left $B_PACK)
    pack_dev=cuda
    [ "$dry" = 1 ] && pack_dev=cpu
    if section "link_cost: host time and device calls per pack / unpack, \`--device $pack_dev\`" "$budget"; then
        t0=$SECONDS
        timeout -k 10 "$budget" "$PY" benches/python/link_cost.py --device "$pack_dev" --rounds 3 \
            --json "$OUT/bench/link_cost.json" | tee -a "$SUMMARY"
        verdict "${PIPESTATUS[0]}" $((SECONDS - t0)) "$budget"
    fi
fi

# ---- the host update's thread scaling on the device's host ---------------------------------------
if [ "$B_THREADS" -gt 0 ]; then
    budget=$(budget_left $B_THREADS)
    threads_args=(--params 32e6 --threads 1,2,4,8,16 --rounds 3 --copy-mib 512)
    [ "$dry" = 1 ] && threads_args=(--params 2e6 --threads 1,2 --rounds 2 --copy-mib 16)
    if section "optim_threads: the Rust AdamW against a copy, \`${threads_args[*]}\`" "$budget"; then
        t0=$SECONDS
        timeout -k 10 "$budget" "$PY" benches/python/optim_threads.py "${threads_args[@]}" \
            | tee -a "$SUMMARY"
        verdict "${PIPESTATUS[0]}" $((SECONDS - t0)) "$budget"
    fi
fi

# ---- the other gpu-marked tests ----------------------------------------------------------------
if [ "$B_OTHERS" -gt 0 ]; then
    # the optimizer's first: a timeout then loses the recompute tests (a first-use calibration
    # with ~2 GiB of swap I/O), not the optimizer's
    # test_planner.py's: the calibration's forward dispatch per op (two clocks on CUDA)
    pytest_step "tests: the gpu-marked tests of test_optim.py, test_optim_staged.py, test_optim_delayed.py, test_recompute.py, test_planner.py" \
        $B_OTHERS others tests/python/test_optim.py tests/python/test_optim_staged.py \
        tests/python/test_optim_delayed.py tests/python/test_recompute.py \
        tests/python/test_planner.py -m gpu
fi

say "" "## total: $([ $status = 0 ] && echo "✓ every step passed" || echo "✗ a step failed") in ${SECONDS} s (deadline ${DEADLINE} s)"
exit $status
