"""Build every C++ kernel now (`make install` runs this), so a server starts on built kernels.

Prints one line per kernel. Exits non-zero when a kernel that this machine could build failed
to (the error is printed): a broken kernel shows at install, not on a server's first start. A
machine without a compiler or ninja, or TOKENLINE_CPU_KERNELS=0, builds none and says so.
"""

from __future__ import annotations

import sys
import time

from services.scheduler import native


def main() -> int:
    failed = 0
    for ext in native.EXTENSIONS:
        start = time.perf_counter()
        state = ext.kernels() if ext.state is None else ext.state
        took = time.perf_counter() - start
        if state.module is not None:
            print(f"{ext.what}: built ({took:.1f} s) from {ext.source.name}")
        elif state.error:
            failed += 1
            print(f"{ext.what}: BUILD FAILED: {state.error}", file=sys.stderr)
        else:
            print(f"{ext.what}: not built ({state.missing}); plain torch runs instead")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
