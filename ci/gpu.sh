#!/usr/bin/env bash
# One GPU round on a CUDA host: build the extension, run the GPU tests, a smoke stress run,
# the probe and a quick bench. Every step runs even when an earlier one fails; the exit status
# is non-zero when any failed. Logs and reports go under $OUT (default ./out); wheels carried
# in .whl/ (e.g. nvtx for a bare GPU image) are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
: > "$LOG"
failed=()

step() {  # step NAME COMMAND...: run, log, remember a failure
  local name=$1; shift
  echo "== $name: $*" | tee -a "$LOG"
  local start=$SECONDS
  "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$LOG"
  [ $rc -eq 0 ] || failed+=("$name")
  return 0
}

has_command() { python3 -m kvverify --help 2>/dev/null | grep -qE "^    $1 "; }

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvverify-site .whl/*.whl
  export PYTHONPATH=/tmp/kvverify-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

step platform bash -c 'nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv; python3 -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda)"'
step build env KVVERIFY_REQUIRE_EXTENSION=1 MAX_JOBS="$(nproc)" python3 -m pip install --no-build-isolation --no-deps -e .
step gpu-tests python3 -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml"
grep -E "passed|failed|error" "$LOG" | tail -n 1
if has_command stress; then
  # The smoke campaign (Llama-3.1-8B pages) and the same cells with a second preset's geometry.
  step stress-smoke python3 -m kvverify stress --max-seconds 300 --json "$OUT/stress.json" --junit "$OUT/stress-junit.xml"
  step stress-smoke-qwen python3 -m kvverify stress --model qwen2.5-7b --max-seconds 300 --json "$OUT/stress-qwen.json"
fi
if has_command probe; then
  step probe python3 -m kvverify probe --json "$OUT/probe.json"
fi
if has_command bench; then
  step bench python3 -m kvverify bench --quick --json "$OUT/bench.json" --plot "$OUT/bench.png"
fi
step swap-bandwidth python3 benchmarks/bench_swap.py
step kernel-bandwidth python3 benchmarks/bench_kernels.py

if [ ${#failed[@]} -ne 0 ]; then
  echo "ci/gpu.sh: failed steps: ${failed[*]}" | tee -a "$LOG"
  exit 1
fi
echo "ci/gpu.sh: all steps passed" | tee -a "$LOG"
