"""What the scheduler child starts with, beyond the flags: its malloc and its cores.

Both must be in place before the process starts: LD_PRELOAD is read by the dynamic loader, and
libgomp reads OMP_PLACES / OMP_PROC_BIND once, when torch loads it.
"""

from __future__ import annotations

import os

from common import malloc
from common.config import ServerArgs, parse_cpu_list


def bound_cores(args: ServerArgs) -> list[int] | None:
    """The cores `--omp-threads-bind` pins the OpenMP threads to (None: not pinned)."""
    if args.omp_threads_bind == "none":
        return None
    if args.omp_threads_bind == "auto":
        return sorted(os.sched_getaffinity(0))
    return parse_cpu_list(args.omp_threads_bind)


def scheduler_env(args: ServerArgs, env: dict[str, str]) -> dict[str, str]:
    """`env` for the scheduler child. Raises ValueError (naming the flag) for a malloc that is
    not installed, or already preloaded against --malloc system, or more threads than bound
    cores."""
    if args.malloc == "system" and (other := malloc.preloaded(env.get("LD_PRELOAD", ""))):
        raise ValueError(f"--malloc system: LD_PRELOAD loads {other} into every process; unset "
                         "it, or use --malloc auto")
    env = malloc.preload_env(env, malloc.resolve(args.malloc))
    cores = bound_cores(args)
    if cores is None:
        return env
    if args.num_threads and args.num_threads > len(cores):
        raise ValueError(f"--num-threads {args.num_threads} is more than the "
                         f"{len(cores)} cores of --omp-threads-bind {args.omp_threads_bind}")
    threads = args.num_threads or len(cores)
    # one place per core, the team's threads in order on them (vLLM's
    # VLLM_CPU_OMP_THREADS_BIND pins the same way, thread i to the i-th core)
    return {**env, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "close",
            "OMP_PLACES": ",".join(f"{{{c}}}" for c in cores[:threads])}
