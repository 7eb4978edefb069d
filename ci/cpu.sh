#!/usr/bin/env bash
# The CI job for hosts without a GPU. Into the active Python it installs torch 2.14.1 (a CUDA 13.0
# build: 5.6 GB in a virtual environment, 3.2 GB of it CUDA libraries), the build tools, and this package with its test
# and plot extras; it builds the extension (it must compile and link: nvcc 13.0 here) and runs the
# CPU suite. GPU tests are collected and skipped; pytest's "no tests ran" (exit 5) fails the job.
# Then the tests that read what a terminal shows run again at another width (no test may depend on
# the width), and the job fails if the tests left anything outside pytest's temporary folders.
#
#   KVVERIFY_CPU_ONLY=1 bash ci/cpu.sh   on a host without nvcc: no extension; its tests skip
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf 'ci/cpu.sh: %s\n' "$*"; }  # before each step that runs a while silent

say "installing torch 2.14.1 (a CUDA 13.0 build: 5.6 GB to download the first time), setuptools and ninja"
python3 -m pip install -q "torch==2.14.1" "setuptools>=70.1" ninja
if [ "${KVVERIFY_CPU_ONLY:-}" != 1 ]; then
  say "building the extension kvverify._C (about a minute on 2 cores) and installing kvverify[test,plot]"
else
  say "installing kvverify[test,plot] without the extension (KVVERIFY_CPU_ONLY=1)"
fi
MAX_JOBS="${MAX_JOBS:-2}" python3 -m pip install -q --no-build-isolation -e ".[test,plot]"
if [ "${KVVERIFY_CPU_ONLY:-}" != 1 ]; then
  python3 -c "import torch, kvverify._C; print('kvverify._C built for torch', torch.__version__)"
fi

# A temporary folder and a torch extension cache of the suite's own: whatever lands there outside
# pytest's folder (pytest-of-$USER) is something a test left behind.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/tmp"
export TMPDIR="$scratch/tmp" TORCH_EXTENSIONS_DIR="$scratch/torch_extensions"
# hypothesis keeps its example database (and caches) there too, not in the checkout's .hypothesis/
# (an environment variable hypothesis reads but does not promise: the check at the end holds it)
export HYPOTHESIS_STORAGE_DIRECTORY="$scratch/hypothesis"
checkout_had_hypothesis="$([ -e .hypothesis ] && echo 1 || true)"

say "the CPU suite"
python3 -m pytest -q -p no:cacheprovider "$@"

# The command line, help, report and warning screens, again at a width the first run did not have.
WIDTH_TESTS=(tests/test_screen.py tests/test_nvtx.py tests/test_cli.py tests/check/test_checker_cli.py
             tests/stress/test_render.py tests/stress/test_merge.py tests/stress/test_merge_input.py
             tests/stress/test_rounds.py tests/record/test_record_cli.py tests/measure/test_probe_bench_cli.py)
other=37
if [ "${COLUMNS:-}" = 37 ]; then other=100; fi
say "the screen tests again at COLUMNS=$other"
COLUMNS=$other python3 -m pytest -q -p no:cacheprovider "${WIDTH_TESTS[@]}"

left="$(find "$TMPDIR" "$TORCH_EXTENSIONS_DIR" -mindepth 1 -maxdepth 1 ! -name "pytest-of-*" 2>/dev/null || true)"
if [ -z "$checkout_had_hypothesis" ] && [ -e .hypothesis ]; then
  left="$left${left:+$'\n'}$PWD/.hypothesis"
fi
if [ -n "$left" ]; then
  printf 'ci/cpu.sh: the tests left these outside pytest'"'"'s temporary folders:\n%s\n' "$left" >&2
  exit 1
fi
