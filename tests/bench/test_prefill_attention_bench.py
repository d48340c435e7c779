"""`python -m bench.prefill_attention`: one row per dtype and case, both sides timed; the extend
grid says which side the model runner's route picks."""

from __future__ import annotations

import re

import pytest
import torch

from bench import prefill_attention
from services.scheduler.attention.torch_backend import prefill_kernels
from services.scheduler.executor.model_runner import _sdpa_route


@pytest.fixture(autouse=True)
def _kernel():
    if prefill_kernels().missing:  # the bench refuses to run without it (a usage error)
        pytest.skip(f"{prefill_kernels().missing}: no C++ prefill kernel to time")


def test_the_table_has_a_row_per_dtype_and_case(capsys):
    assert prefill_attention.main(["--lengths", "40,77", "--repeats", "1",
                                   "--extends", "100:60,20:8"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if re.match(r"\| (float32|bfloat16) \|", line)]
    # two prompt lengths, the burst, two extends; then the grid's two; two dtypes
    assert len(rows) == 2 * (2 + 3) + 2 * 2
    grid = [r for r in rows if re.match(r"\| \w+ \| \d+ after \d+ \|", r)]
    assert len(grid) == 4
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        sdpa, ours = (float(x) for x in (cells[3:5] if row in grid else cells[2:4]))
        assert sdpa > 0 and ours > 0
    for row in grid:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        new, cached = (int(v) for v in cells[1].split(" after "))
        route = _sdpa_route(getattr(torch, cells[0]))
        takes = route is not None and route.takes(new, cached + new)
        assert cells[-1] == ("SDPA" if takes else "kernel"), row


@pytest.mark.parametrize("bad", ["100", "a:b", "0:50", "100:1"])
def test_a_bad_extend_grid_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        prefill_attention.main(["--extends", bad])
    assert exit_.value.code == 2 and "--extends" in capsys.readouterr().err
