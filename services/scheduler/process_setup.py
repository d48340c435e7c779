"""What the scheduler process was started with, against what its flags ask for.

Its malloc (LD_PRELOAD, read by the dynamic loader) and its OpenMP binding (OMP_PLACES and
OMP_PROC_BIND, read by libgomp once, when torch loads it) are fixed before the process runs.
`tokenline serve` sets both up for its scheduler child (services/launcher/scheduler_env.py); a
scheduler started on its own (`python -m services.scheduler`, as compose runs it) cannot, so a
flag asking for what the process did not get is a start-up error naming the flag, not a server
that runs otherwise. The defaults ask for nothing: `--malloc auto` is whatever malloc the
process runs (logged at start), `--omp-threads-bind none` leaves the threads where the OS (or an
OMP_PLACES of the environment) puts them.
"""

from __future__ import annotations

from collections.abc import Mapping

from common import malloc
from common.config import ServerArgs, format_cpu_list, parse_cpu_list

ALONE = "only `tokenline serve` sets that up, before the process starts; started alone, set"


def check(args: ServerArgs, running: tuple[str, str | None], environ: Mapping[str, str],
          affinity: set[int]) -> None:
    """Raises ValueError naming the flag whose value this process does not run with.
    `running` is `malloc.running()`, `affinity` the cores the process may run on."""
    name, library = running
    if args.malloc in ("tcmalloc", "jemalloc") and name != args.malloc:
        found = malloc.find(args.malloc)
        preload = f"LD_PRELOAD={found}" if found else (
            f"LD_PRELOAD to {args.malloc}'s library (install {malloc.PACKAGES[args.malloc]})")
        raise ValueError(f"--malloc {args.malloc}: this scheduler runs {_malloc_name(name)}; "
                         f"{ALONE} {preload} in its environment, or use --malloc auto")
    if args.malloc == "system" and name != "glibc":
        raise ValueError(f"--malloc system: this scheduler runs {name} ({library}), preloaded "
                         "by LD_PRELOAD; unset it, or use --malloc auto")
    if args.omp_threads_bind == "none":
        return
    cores = (sorted(affinity) if args.omp_threads_bind == "auto"
             else parse_cpu_list(args.omp_threads_bind))
    # bound: libgomp was given places, and the process stays on the named cores
    if not environ.get("OMP_PLACES") or not affinity <= set(cores):
        places = ",".join(f"{{{c}}}" for c in cores)
        raise ValueError(f"--omp-threads-bind {args.omp_threads_bind}: {ALONE} OMP_PLACES="
                         f"{places} OMP_PROC_BIND=close and its CPU affinity (taskset -c "
                         f"{format_cpu_list(cores)}) in its environment, or leave the flag at "
                         "none")


def _malloc_name(name: str) -> str:
    return "glibc's malloc" if name == "glibc" else name
