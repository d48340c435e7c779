"""`tokenline serve` at its defaults preloads tcmalloc into the scheduler process where the
library is installed (Debian's libtcmalloc-minimal4), and says so at start-up; the other
services keep glibc's malloc."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from common import malloc
from tests.e2e.reliability import service_pids, tiny_stack

TCMALLOC = malloc.find("tcmalloc")


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with tiny_stack(tiny_model_dir) as s:
        yield s


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(TCMALLOC is None, reason="no tcmalloc library on this machine "
                    "(libtcmalloc-minimal4)")
def test_scheduler_runs_tcmalloc_where_it_is_installed(stack):
    pids = service_pids(stack)
    assert malloc.running(_maps(pids["scheduler"])) == ("tcmalloc", str(TCMALLOC.resolve()))
    assert malloc.running(_maps(pids["gateway"]))[0] == "glibc"  # only the scheduler's steps
    assert "malloc: tcmalloc" in stack.logs()
    # and it serves
    r = requests.post(stack.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_auto_runs_glibc_where_no_library_is_installed(monkeypatch):
    monkeypatch.setattr(malloc, "_LIB_DIRS", ("/nonexistent",))
    assert malloc.resolve("auto") is None
    assert malloc.preload_env({"A": "1"}, None) == {"A": "1"}
    with pytest.raises(ValueError, match="--malloc tcmalloc: no tcmalloc library found"):
        malloc.resolve("tcmalloc")
