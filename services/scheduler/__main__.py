import os

# Large tensors (the weights, the KV cache, a step's activations) on 2 MiB pages: c10 reads this
# once, at torch's first allocation, and then madvises every allocation of 2 MiB or more (the
# kernel's THP mode `madvise` honours it; `never` ignores it). A step streams hundreds of MB of
# weights and K/V, and on 4 KiB pages each page costs a TLB walk: measured single-threaded
# (bench.step_profile --threads 1, alternating, shared machine), a batch-1 float32 step
# 17.0-18.2 against 18.4-19.8 ms, batch 64's attention 39.5-40.8 against 41.4-47.3 ms.
# THP_MEM_ALLOC_ENABLE=0 in the environment turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from common.service import main  # noqa: E402
from services.scheduler.server import SchedulerService  # noqa: E402

if __name__ == "__main__":
    main(SchedulerService, "scheduler")
