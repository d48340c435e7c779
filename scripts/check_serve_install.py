"""Check that a serving install holds no test package: run with the venv's own python after
`make VENV=... install-serve`. The test packages are pyproject.toml's `test` extras (their
names, as pip normalises them); exits 1 naming any that is installed."""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_packages() -> set[str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {normalise(re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0])
            for req in extras["optional-dependencies"]["test"]}


def main() -> int:
    installed = {normalise(d.metadata["Name"]) for d in metadata.distributions()}
    wanted = test_packages()
    found = sorted(installed & wanted)
    if found:
        print(f"the serving install holds test packages: {', '.join(found)}")
        return 1
    print(f"serving install: {len(installed)} packages, none of the {len(wanted)} test ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
