"""The scheduler's C++ CPU kernels: each source file in this folder one extension.

Each `Extension` is one .cpp file here, built with `torch.utils.cpp_extension.load` and loaded
from torch's cache (~/.cache/torch_extensions) after that. `make install` builds all of them
(`python -m services.scheduler.native`), so a server starts on built kernels and a compile
error shows at install; a process that finds one unbuilt builds it on first use (tens of
seconds). Where the machine cannot
build it (no compiler, no ninja, or switched off with TOKENLINE_CPU_KERNELS=0) the callers run
plain torch. A build that should have worked and did not is kept as an error: users still get
the torch path, and with TOKENLINE_CPU_KERNELS=require (the test suite sets it) it raises.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from common.logging import get_logger

log = get_logger("native")

# -fopenmp: at::parallel_for is an OpenMP loop only when the extension is built so
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is no such file):
    what -march=native builds for, and what the run-time choices that depend on the CPU read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@dataclass
class NativeKernels:
    """One extension: its module, or why there is none. `missing` says what the machine lacks
    (or that it was switched off); `error` is a build that failed."""

    module: object | None = None
    missing: str | None = None
    error: str | None = None


class Extension:
    """One C++ source, built (or found wanting) once per process."""

    def __init__(self, source: Path, what: str) -> None:
        self.source = source
        self.what = what  # for log lines and errors: "the CPU decode kernel"
        self._state: NativeKernels | None = None
        EXTENSIONS.append(self)

    @property
    def state(self) -> NativeKernels | None:
        """What was built, or None when no one in this process asked yet."""
        return self._state

    def kernels(self) -> NativeKernels:
        if self._state is None:
            self._state = self._build()
        if self._state.error and os.environ.get("TOKENLINE_CPU_KERNELS") == "require":
            raise RuntimeError(f"{self.what} did not build: {self._state.error}")
        return self._state

    def module(self):
        """The built module, or None where it cannot be built."""
        return self.kernels().module

    def _build(self) -> NativeKernels:
        if os.environ.get("TOKENLINE_CPU_KERNELS", "1") == "0":
            return NativeKernels(missing="switched off (TOKENLINE_CPU_KERNELS=0)")
        missing = _toolchain_missing()
        if missing:
            log.info(f"{missing}: {self.what} is not built, plain torch runs instead")
            return NativeKernels(missing=missing)
        try:
            module = self._load()
        except Exception as exc:  # noqa: BLE001 - a failed build: the torch path, and say why
            log.warning(f"could not build {self.what}, using plain torch: {exc}")
            return NativeKernels(error=f"{type(exc).__name__}: {exc}")
        return NativeKernels(module=module)

    def _load(self):
        """Build (or find built) and import, one process at a time per build. torch's own
        guard is a lock file that a killed build leaves behind, and every later build then
        waits on it forever; ours is an flock, which the OS drops with its holder, so under it
        a torch lock file can only be such a leftover and goes."""
        name = self._name()
        build_dir = build_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir.with_name(name + ".flock"), "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            return torch.utils.cpp_extension.load(
                name=name, sources=[str(self.source)], extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"], build_directory=str(build_dir))

    def _name(self) -> str:
        """-march=native: the build is for this CPU, so the CPU's flags are part of its name; so
        is the source's path, which ninja's build file holds: two checkouts sharing one build
        directory would rebuild it for each other on every load. The headers it includes are
        hashed with the source: an edit to one is a new build, never a stale module."""
        flags = " ".join(sorted(cpu_flags()))
        headers = [h.read_bytes() for h in local_headers(self.source)]
        key = hashlib.sha256(b"\0".join([self.source.read_bytes(), *headers,
                                         str(self.source).encode(), flags.encode(),
                                         torch.__version__.encode(), " ".join(CFLAGS).encode()]))
        return f"tokenline_{self.source.stem}_{key.hexdigest()[:12]}"


def build_root() -> Path:
    """Where torch keeps JIT builds (TORCH_EXTENSIONS_DIR, else its cache), per Python."""
    import torch.utils.cpp_extension as cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


EXTENSIONS: list[Extension] = []
HERE = Path(__file__).parent
# the kernels, each named for its log lines and errors
DECODE = Extension(HERE / "paged_decode_cpu.cpp", "the CPU decode kernel")
PREFILL = Extension(HERE / "paged_prefill_cpu.cpp", "the CPU prefill kernel")
OPS = Extension(HERE / "ops_cpu.cpp", "the CPU fused ops")
QUANT = Extension(HERE / "quant_cpu.cpp", "the CPU matmul kernels (int8, int4, float32 tiles)")

LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def local_headers(source: Path) -> list[Path]:
    """The files a source names in `#include "..."` (relative to the includer, as the compiler
    looks first), and theirs in turn, in the order met; a name not found there is left to the
    compiler's own search path, which holds none of ours."""
    found: list[Path] = []
    todo = [source]
    while todo:
        current = todo.pop(0)
        for name in LOCAL_INCLUDE.findall(current.read_text()):
            header = (current.parent / name).resolve()
            if header.is_file() and header not in found:
                found.append(header)
                todo.append(header)
    return found


def _toolchain_missing() -> str | None:
    import torch.utils.cpp_extension as cpp_extension

    # pip's ninja (a dependency) sits next to the interpreter, which need not be on PATH
    here = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (here / "ninja").exists() and str(here) not in path.split(os.pathsep):
        os.environ["PATH"] = f"{here}{os.pathsep}{path}"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx} is not on PATH)"
    if not cpp_extension.is_ninja_available():
        return "no ninja"
    return None
