#!/usr/bin/env bash
# GPU check: the Triton attention kernels' tests compiled on CUDA, then the decode benchmark.
#
# Assumptions (kept simple on purpose):
# - Run on a machine with an NVIDIA GPU and its driver, from anywhere in the repo.
# - A virtualenv at .venv (or PY=/path/to/python) normally exists already with the project
#   installed; then nothing is downloaded. Only if it is missing or broken is .venv created
#   and filled from PyPI (needs network, a few minutes): torch, then the project with [test].
# - If the venv's torch has no CUDA (the CPU wheel used on dev boxes), the CPU build is
#   swapped for PyPI's default torch==2.13.0 wheel, which is the CUDA build on Linux x86_64.
# - Bandwidth for the roofline fraction defaults to the H200's 4.8 TB/s: BANDWIDTH_TBS=3.35
#   for an H100 SXM, for instance.
# Budget: under 8 minutes on a warm venv (tests ~1-2 min including Triton compiles, bench
# ~2-3 min); each step has its own timeout so one hang cannot eat the rest.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
BANDWIDTH_TBS=${BANDWIDTH_TBS:-4.8}

if ! "$PY" -c 'import torch, triton, pytest' >/dev/null 2>&1; then
    echo "== creating .venv (torch, triton or pytest missing)"
    python3 -m venv .venv
    PY=.venv/bin/python
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q -e '.[test]'
fi

if [ "$("$PY" -c 'import torch; print(torch.cuda.is_available())')" != "True" ]; then
    echo "== torch $("$PY" -c 'import torch; print(torch.__version__)') sees no GPU:" \
         "installing the default (CUDA) torch from PyPI"
    # A CPU build satisfies ==2.13.0 (2.13.0+cpu), so it has to go first.
    "$PY" -m pip uninstall -q -y torch
    "$PY" -m pip install -q --index-url https://pypi.org/simple torch==2.13.0
    if [ "$("$PY" -c 'import torch; print(torch.cuda.is_available())')" != "True" ]; then
        echo "torch still sees no GPU (driver missing?): nothing to check here" >&2
        nvidia-smi >&2 || true
        exit 1
    fi
fi
"$PY" -c 'import torch, triton; print("== torch", torch.__version__, "triton", triton.__version__,
      "on", torch.cuda.get_device_name())'

echo "== Triton attention tests, compiled on CUDA"
# Unset so the kernels compile instead of running in the interpreter.
env -u TRITON_INTERPRET timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/unit/test_triton_attention.py

echo "== decode benchmark (random weights, bf16, context 1024)"
env -u TRITON_INTERPRET timeout 300 "$PY" scripts/gpu_bench.py --bandwidth-tbs "$BANDWIDTH_TBS"

# ---- PLACEHOLDER: short serving run --------------------------------------------------
# To be replaced by the owners of the offline engine/bench with a real short run (a few
# hundred requests through `tokenline bench offline`, reporting throughput). Until that
# command exists, this only checks for it.
if "$PY" -m tokenline.cli bench offline --help >/dev/null 2>&1; then
    echo "== serving run (placeholder: prints the command's help only)"
    timeout 60 "$PY" -m tokenline.cli bench offline --help
else
    echo "== serving run skipped: 'python -m tokenline.cli bench offline' is not there yet"
fi
# ---- end PLACEHOLDER ------------------------------------------------------------------

echo "== GPU check done"
