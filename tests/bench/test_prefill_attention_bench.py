"""`python -m bench.prefill_attention`: one row per dtype and case, both sides timed."""

from __future__ import annotations

import re

import pytest

from bench import prefill_attention
from services.scheduler.attention.torch_backend import prefill_kernels


def test_the_table_has_a_row_per_dtype_and_case(capsys):
    if prefill_kernels().missing:  # the bench refuses to run without it (a usage error)
        pytest.skip(f"{prefill_kernels().missing}: no C++ prefill kernel to time")
    assert prefill_attention.main(["--lengths", "40,77", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if re.match(r"\| (float32|bfloat16) \|", line)]
    assert len(rows) == 2 * (2 + 3)  # two prompt lengths, the burst, two extends; two dtypes
    for row in rows:
        sdpa, ours = (float(x) for x in row.split("|")[3:5])
        assert sdpa > 0 and ours > 0
