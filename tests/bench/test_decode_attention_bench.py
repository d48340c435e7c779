"""`python -m bench.decode_attention`: a row per dtype and layout, the kernel and the read timed."""

from __future__ import annotations

import re

import pytest

from bench import decode_attention
from services.scheduler.attention.torch_backend import native_kernels


def test_the_table_has_a_row_per_dtype_and_layout(capsys):
    if native_kernels().missing:  # nothing to time without the kernel
        pytest.skip(f"{native_kernels().missing}: no C++ decode kernel to time")
    assert decode_attention.main(["--layers", "2", "--rounds", "1",
                                 "--layout", "contiguous,shuffled,hot"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if re.match(r"(float32|bfloat16) +(contiguous|shuffled|hot) ", line)]
    assert len(rows) == 2 * 3
    for row in rows:
        speeds = [float(x) for x in re.findall(r"([\d.]+) GB/s", row)]
        assert len(speeds) == 2 and all(x > 0 for x in speeds)  # the kernel, the plain read


def test_a_step_reads_each_request_once_from_its_own_blocks():
    """The layouts: contiguous blocks one after another, shuffled ones a permutation of the
    same pool, hot ones shared by every request; the byte count is what the kernel reads."""
    import torch

    lens = [c + 1 for c in decode_attention.CONTEXTS]
    need = [-(-n // decode_attention.PAGE) for n in lens]
    for layout in ("contiguous", "shuffled", "hot"):
        step = decode_attention.Step(torch.float32, layout, layers=1)
        used = [step.tables[b, : need[b]].tolist() for b in range(len(lens))]
        flat = [x for blocks in used for x in blocks]
        if layout == "hot":
            assert all(blocks == list(range(len(blocks))) for blocks in used)
        else:
            assert len(set(flat)) == len(flat) == sum(need)  # no block shared
        if layout == "contiguous":
            assert flat == list(range(sum(need)))
        assert step.bytes == sum(lens) * 3 * 64 * 2 * 4


def test_against_a_revision_writes_the_kernel_with_the_headers_it_includes():
    """`--against REV` builds the kernel as it was at REV: the source and every header it
    includes (cpu_vec.h, one folder up) in a tree laid out as the repository is, so that the
    compiler finds them (before, the source was copied alone and the build failed)."""
    import subprocess
    from pathlib import Path

    from services.scheduler.native import local_headers

    source = decode_attention.native.DECODE.source
    path = decode_attention.source_at("HEAD")
    assert path.name == source.name
    assert path.read_text() == subprocess.check_output(
        ["git", "show", "HEAD:services/scheduler/native/paged_decode_cpu.cpp"],
        cwd=source.parent, text=True)
    headers = local_headers(path)
    assert [h.name for h in headers] == ["cpu_vec.h"]
    tree = Path(*path.parts[: len(path.parts) - 4])  # the temporary repository root
    assert headers[0] == (tree / "services/scheduler/native/cpu_vec.h").resolve()


def test_page_sizes_each_get_their_rows_and_blocks_of_that_size(capsys):
    """`--page 16,64`: a row per block size, and a step's tables hold blocks of that many
    positions (the same bytes read either way)."""
    import torch

    if native_kernels().missing:
        pytest.skip(f"{native_kernels().missing}: no C++ decode kernel to time")
    assert decode_attention.main(["--dtype", "float32", "--layout", "shuffled", "--contexts",
                                  "300", "--batch", "2", "--layers", "1", "--rounds", "1",
                                  "--page", "16,64"]) == 0
    out = capsys.readouterr().out
    assert "OMP_WAIT_POLICY" in out.splitlines()[0]
    assert [m for m in re.findall(r"shuffled +page (\d+) ", out)] == ["16", "64"]
    small, large = (decode_attention.Step(torch.float32, "shuffled", 1, contexts=[300] * 2,
                                          page=p) for p in (16, 64))
    for step, page in ((small, 16), (large, 64)):
        need = -(-301 // page)  # positions 0..300 of each request
        used = [step.tables[b, :need].tolist() for b in range(2)]
        assert len({x for blocks in used for x in blocks}) == 2 * need  # none shared
        assert step.caches[0][0].shape[0] % page == 0
        assert step.slots.tolist() == [blocks[300 // page] * page + 300 % page for blocks in used]
    assert large.bytes == small.bytes
