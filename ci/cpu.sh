#!/usr/bin/env bash
# The CI job for hosts without a GPU: install torch (CUDA 13.0 build) and the test tools, build
# the extension (it must compile and link: KVVERIFY_REQUIRE_EXTENSION=1), run the CPU suite.
# GPU tests are collected and skipped; pytest's "no tests ran" (exit 5) fails the job.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.14.1" "setuptools>=69" ninja
KVVERIFY_REQUIRE_EXTENSION=1 MAX_JOBS="${MAX_JOBS:-2}" \
  python3 -m pip install -q --no-build-isolation -e ".[test,plot]"
python3 -c "import torch, kvverify._C; print('kvverify._C built for torch', torch.__version__)"
python3 -m pytest -q -p no:cacheprovider "$@"
