"""Which malloc the scheduler process runs: the launcher preloads one, the process reports it.

A step allocates and frees the same few hundred tensors of varying sizes every few ms; glibc's
arenas fragment under that (RSS creeps up) and take locks tcmalloc's per-thread caches do not.
vLLM's CPU docs preload tcmalloc for the same reason. The library comes from the OS package
(Debian's libtcmalloc-minimal4, or libjemalloc2), never from us: where it is absent, `auto`
runs glibc's malloc and says so.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

CHOICES = ("auto", "tcmalloc", "jemalloc", "system")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
             "/usr/lib", "/lib/x86_64-linux-gnu", "/usr/local/lib")
_NAMES = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
}
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}  # Debian's
# a mapped file whose name holds this is that malloc
_MARKS = {"tcmalloc": "libtcmalloc", "jemalloc": "libjemalloc"}


def find(kind: str) -> Path | None:
    """The shared library of `kind` (tcmalloc or jemalloc) on this machine, if any."""
    for d in _LIB_DIRS:
        for name in _NAMES[kind]:
            path = Path(d) / name
            if path.is_file():
                return path
    return None


def resolve(choice: str) -> Path | None:
    """The library `--malloc CHOICE` preloads (None: glibc's own). `auto` takes tcmalloc, else
    jemalloc, else none; a named one that is missing is an error naming the flag."""
    if choice == "system":
        return None
    if choice == "auto":
        return find("tcmalloc") or find("jemalloc")
    if choice not in _NAMES:
        raise ValueError(f"--malloc {choice!r}: choose from {', '.join(CHOICES)}")
    path = find(choice)
    if path is None:
        raise ValueError(f"--malloc {choice}: no {choice} library found (install "
                         f"{PACKAGES[choice]}, or use --malloc auto or system)")
    return path


def preload_env(env: dict[str, str], library: Path | None) -> dict[str, str]:
    """`env` with `library` first in LD_PRELOAD (unchanged for None)."""
    if library is None:
        return env
    rest = env.get("LD_PRELOAD", "")
    return {**env, "LD_PRELOAD": f"{library}:{rest}" if rest else str(library)}


def preloaded(ld_preload: str) -> str | None:
    """The malloc (tcmalloc or jemalloc) an LD_PRELOAD value loads, if any."""
    for path in ld_preload.replace(" ", ":").split(":"):
        for name, mark in _MARKS.items():
            if mark in Path(path).name:
                return name
    return None


def running(maps: str | None = None) -> tuple[str, str | None]:
    """(name, library path) of the malloc this process runs, read from its own memory map:
    ("tcmalloc", path), ("jemalloc", path) or ("glibc", None)."""
    if maps is None:
        try:
            maps = Path(f"/proc/{os.getpid()}/maps").read_text()
        except OSError:
            return "glibc", None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
        for name, mark in _MARKS.items():
            if mark in Path(path).name:
                return name, path
    return "glibc", None


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS, under whichever malloc runs."""
    try:
        lib = ctypes.CDLL(None)
    except OSError:
        return
    for symbol in ("MallocExtension_ReleaseFreeMemory", "malloc_trim"):  # tcmalloc, glibc
        fn = getattr(lib, symbol, None)
        if fn is not None:
            fn(*(() if symbol.startswith("Malloc") else (0,)))
            return
