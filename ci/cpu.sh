#!/usr/bin/env bash
# The CI job for hosts without a GPU. Into the active Python it installs torch 2.14.1 (a CUDA 13.0
# build: 5.6 GB in a virtual environment, 3.2 GB of it CUDA libraries), the build tools, and this package with its test
# and plot extras; it builds the extension (it must compile and link: nvcc 13.0 here) and runs the
# CPU suite. GPU tests are collected and skipped; pytest's "no tests ran" (exit 5) fails the job.
#
#   KVVERIFY_CPU_ONLY=1 bash ci/cpu.sh   on a host without nvcc: no extension; its tests skip
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.14.1" "setuptools>=70.1" ninja
MAX_JOBS="${MAX_JOBS:-2}" python3 -m pip install -q --no-build-isolation -e ".[test,plot]"
if [ "${KVVERIFY_CPU_ONLY:-}" != 1 ]; then
  python3 -c "import torch, kvverify._C; print('kvverify._C built for torch', torch.__version__)"
fi
python3 -m pytest -q -p no:cacheprovider "$@"
