#!/usr/bin/env bash
# One GPU round on a CUDA host: build the extension, run the GPU tests, a smoke stress run
# with two presets, the NVTX overhead A/B, the probe and a quick bench. Every step runs even
# when an earlier one fails; the exit status is non-zero when any failed. Logs and reports go
# under $OUT (default ./out); wheels carried in .whl/ (e.g. nvtx for a bare GPU image) are
# installed first.
#
#   ci/gpu.sh                    every step, in order (about 15 minutes on one H200)
#   ci/gpu.sh build gpu-tests    only the named steps (a later call on the same host may skip
#                                `build`: the editable install stays)
#   GPU_TESTS="tests/stress/test_stress_gpu.py" ci/gpu.sh gpu-tests    only these GPU test files
#
# Steps: platform build gpu-tests stress-smoke stress-smoke-qwen nvtx-overhead probe bench
#        swap-bandwidth kernel-bandwidth record kernel-path, and on request only (not in a bare
#        `ci/gpu.sh`):
#        sanitizer       compute-sanitizer memcheck / racecheck / synccheck (ci/sanitize.py), ~10 min
#        soak            the soak campaign capped at 8 minutes (one device call on its own)
#        torchrun-1      the smoke under torchrun with one rank; its verdicts against stress-smoke's
#        stress-2gpu     two GPUs: every cell on each (torchrun --nproc-per-node 2)
#        stress-2gpu-shard  two GPUs, the cells split (--shard)
#        merge           stress-2gpu, stress-2gpu-shard and probe reports merged; every report validated
#        hook-probe      what a C++ op observer would cost the recorder per op (benchmarks/record_hook_probe.py)
#        corpus          the race corpus (docs/corpus.md) with a device witness per race (--confirm): its
#                        table in corpus.md, its JSON in corpus.json
#        record-suite    kvverify record -- pytest -m gpu tests/record: the tests' own recordings nested in it
#        Each has a wall-clock limit (SIGINT, then SIGKILL), so one stuck step cannot eat a lent
#        device's whole call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
: > "$LOG"
failed=()

ALL_STEPS=(platform build gpu-tests stress-smoke stress-smoke-qwen nvtx-overhead probe bench swap-bandwidth
           kernel-bandwidth record kernel-path)
ON_REQUEST=(sanitizer soak torchrun-1 stress-2gpu stress-2gpu-shard merge hook-probe corpus record-suite)
SELECTED=("$@")
[ ${#SELECTED[@]} -ne 0 ] || SELECTED=("${ALL_STEPS[@]}")
for s in "${SELECTED[@]}"; do
  [[ " ${ALL_STEPS[*]} ${ON_REQUEST[*]} " == *" $s "* ]] || {
    echo "ci/gpu.sh: unknown step '$s'; steps: ${ALL_STEPS[*]}; on request: ${ON_REQUEST[*]}" >&2; exit 2; }
done

step() {  # step NAME LIMIT_S COMMAND...: run if selected, under a time limit, log, remember a failure
  local name=$1 limit=$2; shift 2
  [[ " ${SELECTED[*]} " == *" $name "* ]] || return 0
  echo "== $name: $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout --signal=INT --kill-after=30 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$LOG"
  [ $rc -eq 0 ] || failed+=("$name")
  return 0
}

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvverify-site .whl/*.whl
  export PYTHONPATH=/tmp/kvverify-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

step platform 30 bash -c 'nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv; python3 -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda)"'
# Hopper only by default: the lent device is an H200, and device time is short.
step build 300 env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="$(nproc)" \
  python3 -m pip install --no-build-isolation --no-deps -e .
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths
step gpu-tests 480 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" ${GPU_TESTS:-}
grep -E "^=* ?[0-9]+ (passed|failed)|^[0-9]+ (passed|failed)" "$LOG" | tail -n 1
# The smoke campaign (Llama-3.1-8B pages) and the same cells with a second preset's geometry; the
# target is 90 s each, the cap leaves room to see by how much a slow run misses it.
step stress-smoke 200 python3 -m kvverify stress --max-seconds 180 --json "$OUT/stress.json" --junit "$OUT/stress-junit.xml"
step stress-smoke-qwen 200 python3 -m kvverify stress --model qwen2.5-7b --max-seconds 180 --json "$OUT/stress-qwen.json"
# One interleaved pair of smoke runs, annotated and --no-nvtx, and the per-range cost.
step nvtx-overhead 400 python3 benchmarks/bench_nvtx_overhead.py --repeats 1 --json "$OUT/nvtx-overhead.json" \
  --smoke-cmd "python3 -m kvverify stress --max-seconds 180"
step probe 200 python3 -m kvverify probe --json "$OUT/probe.json"
step bench 300 python3 -m kvverify bench --quick --json "$OUT/bench.json" --plot "$OUT/bench.png"
step swap-bandwidth 120 python3 benchmarks/bench_swap.py
step kernel-bandwidth 120 python3 benchmarks/bench_kernels.py
# kvverify record: its GPU tests (hooks, the demo handler's forms, the native-executor self-check over
# the smoke campaign's 162 native cells), the overhead benchmark and the comparison with PyTorch's CSAN.
# All three run; the step fails if any does.
step record 540 bash -c "rc=0; python3 -m pytest -m gpu -q -rs -s -p no:cacheprovider \
  --junitxml=$OUT/record-tests.xml tests/record || rc=1; python3 benchmarks/bench_record.py \
  --json $OUT/bench-record.json || rc=1; python3 benchmarks/compare_csan.py --json $OUT/record-vs-csan.json || rc=1; exit \$rc"
# The SM-kernel copy path (issue 14), 4-6 minutes (estimated; each part capped): its GPU tests, the kernel cells of
# every smoke scenario, the bench at 64 MiB per call with the compute slowdown, the calibration grid
# (paths.json, crossover plot), and the figures against the issue's targets. Every part runs; any
# failure fails the step.
step kernel-path 540 bash -c '
  set -o pipefail; out=$1; rc=0
  python3 -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$out/kernel-path-tests.xml" \
    tests/device/test_kernel_copy_gpu.py tests/measure/test_probe_bench_gpu.py || rc=1
  python3 -m kvverify stress --executors kernel --max-seconds 60 --json "$out/stress-kernel.json" || rc=1
  bench_plot=(); calibrate_plot=()  # plots only where matplotlib is (bench refuses --plot without it)
  if python3 -c "import matplotlib" 2>/dev/null; then
    bench_plot=(--plot "$out/kernel-bench.png"); calibrate_plot=(--plot "$out/crossover.png")
  else echo "kernel-path: no matplotlib here: no plots"; fi
  python3 -m kvverify bench --quick --no-repeat --max-seconds 90 --json "$out/kernel-bench.json" "${bench_plot[@]}" || rc=1
  python3 -m kvverify bench --calibrate --max-seconds 150 -o "$out/paths.json" --json "$out/calibrate.json" \
    "${calibrate_plot[@]}" || rc=1
  python3 benchmarks/bench_copy_paths.py "$out/kernel-bench.json" "$out/paths.json" | tee "$out/kernel-targets.txt" || rc=1
  exit $rc' _ "$OUT"
# compute-sanitizer: memcheck over the op and kernel tests, racecheck and synccheck over the harness
# kernels; tests marked sanitizer_incompatible deselected; only documented noise forgiven (ci/sanitize.py).
step sanitizer 590 python3 ci/sanitize.py --out "$OUT"
# The soak: rounds of trials over every cell until the 8-minute cap (the first round covers the
# matrix in ~2 min); host RSS and device memory trend in the report, exit status 3 if they grew.
step soak 570 python3 -m kvverify stress --campaign soak --max-seconds 480 --json "$OUT/soak.json" \
  --junit "$OUT/soak-junit.xml"
# One rank under torchrun must give the verdicts of the plain smoke run (stress-smoke's report).
step torchrun-1 260 bash -c 'python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m kvverify stress \
  --max-seconds 180 --json "$0/stress-torchrun-1.json" && python3 ci/reports.py same-verdicts "$0/stress.json" \
  "$0/stress-torchrun-1.json"' "$OUT"
# Two GPUs (nvidia-h200-x2): every cell on each GPU at once, then the cells split across them.
step stress-2gpu 260 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m kvverify stress \
  --max-seconds 180 --json "$OUT/stress-2gpu.json"
step stress-2gpu-shard 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m kvverify stress \
  --shard --max-seconds 120 --json "$OUT/stress-2gpu-shard.json"
step merge 120 bash -c 'stress=(); for f in stress.json stress-2gpu.json stress-2gpu-shard.json; do
  [ -f "$0/$f" ] && stress+=("$0/$f"); done; probe=(); [ -f "$0/probe.json" ] && probe=("$0/probe.json")
  python3 -m kvverify merge "${stress[@]}" "${probe[@]}" --json "$0/merged.json"; rc=$?
  python3 ci/reports.py validate "$0/merged.json" "${stress[@]}" || rc=1; exit $rc' "$OUT"
# The recorder's next hook: a C++ op observer's cost per op against the dispatch mode and the recorder.
step hook-probe 240 python3 benchmarks/record_hook_probe.py --device cuda --json "$OUT/hook-probe.json"
# The race corpus: each case's forms natively, recorded (each race witnessed) and under CSAN (one child process); fails when a
# case the dispatcher sees is not RACY with its pair when broken and SAFE when fixed.
# kvverify record over the recorder's own GPU tests (issue 24): each test's own recording nests in it (pausing it). Passes
# when the suite ran and its trace was checked: exit 0 (SAFE), 1 (races) or 2 (no race, the pauses not recorded).
step record-suite 560 bash -c 'python3 -m kvverify record --json "$0/record-suite.json" -o "$0/record-suite-trace.json" \
  -- pytest -m gpu -q -p no:cacheprovider tests/record > "$0/record-suite.log" 2>&1; rc=$?
  tail -n 60 "$0/record-suite.log"; echo "kvverify record: exit $rc"; [ "$rc" -le 2 ]' "$OUT"
step corpus 300 bash -c 'python3 -m kvverify corpus --confirm --json "$0/corpus.json" | tee "$0/corpus.md"
  exit "${PIPESTATUS[0]}"' "$OUT"

if [ ${#failed[@]} -ne 0 ]; then
  echo "ci/gpu.sh: failed steps: ${failed[*]}" | tee -a "$LOG"
  exit 1
fi
echo "ci/gpu.sh: all steps passed" | tee -a "$LOG"
