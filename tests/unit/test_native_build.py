"""The C++ extensions' build names: what they hash decides when a stale module is reloaded."""

from __future__ import annotations

from pathlib import Path

from services.scheduler import native


def _name_of(source: Path) -> str:
    extension = native.Extension(source, "a test kernel")
    try:
        return extension._name()
    finally:
        native.EXTENSIONS.remove(extension)


def test_an_edit_to_an_included_header_is_a_new_build(tmp_path):
    (tmp_path / "kernels").mkdir()
    source = tmp_path / "kernels" / "k.cpp"
    source.write_text('#include <vector>\n#include "../vec.h"\nint f() { return g(); }\n')
    header = tmp_path / "vec.h"
    header.write_text('#pragma once\n  #  include "more.h"\ninline int g() { return 1; }\n')
    (tmp_path / "more.h").write_text("// nothing yet\n")
    assert native.local_headers(source) == [header.resolve(), (tmp_path / "more.h").resolve()]
    first = _name_of(source)
    assert first == _name_of(source)  # the same files: the same build
    header.write_text('#pragma once\n#include "more.h"\ninline int g() { return 2; }\n')
    second = _name_of(source)
    (tmp_path / "more.h").write_text("// one header further down\n")
    third = _name_of(source)
    assert len({first, second, third}) == 3


def test_the_shipped_kernels_hash_the_shared_header():
    shared = (Path(native.__file__).parent / "cpu_vec.h").resolve()

    for extension in (native.DECODE, native.OPS):
        assert shared in native.local_headers(extension.source)


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path, monkeypatch):
    """torch's build guard is a lock file; a build killed while holding it (Ctrl-C in `make
    install`, a test's timeout) used to leave every later build of that kernel waiting forever.
    Under our flock such a file is known to be a leftover and goes."""
    import subprocess
    import sys
    import textwrap

    if native._toolchain_missing():
        import pytest

        pytest.skip(native._toolchain_missing())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    source = tmp_path / "tiny.cpp"
    source.write_text('#include <pybind11/pybind11.h>\nint one() { return 1; }\n'
                      'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("one", &one); }\n')
    extension = native.Extension(source, "a tiny test kernel")
    native.EXTENSIONS.remove(extension)
    build_dir = native.build_root() / extension._name()
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")  # what a killed build leaves
    # in a child with a deadline: the hang this guards against would otherwise hang the suite
    script = textwrap.dedent(f"""
        from pathlib import Path
        from services.scheduler import native
        ext = native.Extension(Path({str(source)!r}), "a tiny test kernel")
        print(ext.module().one())
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(native.__file__).parents[3],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("1")
