"""The house rules that keep the code readable: no function over 50 lines (Triton kernels
aside), checked by the same script a developer runs by hand."""

from pathlib import Path

from scripts.long_functions import long_functions

ROOT = Path(__file__).resolve().parents[2]


def test_no_function_is_longer_than_50_lines():
    roots = [str(ROOT / d) for d in ("services", "common", "tokenline", "bench")]
    assert long_functions(roots, 50) == []


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(50))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    assert [n for n, _ in long_functions([str(tmp_path)], 50)] == [51]
