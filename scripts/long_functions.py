"""Functions longer than a limit (default 50 lines) under the given folders, longest first.

    python scripts/long_functions.py [--limit 50] services common tokenline bench

The Triton kernels (`triton_kernels.py`) are left out: a kernel is one long function by nature.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

SKIP = {"triton_kernels.py"}


def long_functions(roots: list[str], limit: int) -> list[tuple[int, str]]:
    found = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            if path.name in SKIP:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        found.append((n, f"{path}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("roots", nargs="*", default=["services", "common", "tokenline", "bench"])
    parser.add_argument("--limit", type=int, default=50)
    args = parser.parse_args()
    found = long_functions(args.roots, args.limit)
    for n, where in found:
        print(f"{n:4d}  {where}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
