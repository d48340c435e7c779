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
