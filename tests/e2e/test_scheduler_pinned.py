"""`--malloc system --omp-threads-bind CORE`: the scheduler runs glibc's malloc, its OpenMP
threads have one place per bound core, and the process runs on those cores only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from common import malloc
from common.config import parse_server_args
from tests.e2e.reliability import service_pids, tiny_stack
from tests.helpers import REPO

CORE = min(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with tiny_stack(tiny_model_dir, "--malloc", "system",
                    "--omp-threads-bind", str(CORE)) as s:
        yield s


def _status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise KeyError(field)


def test_system_malloc_and_bound_cores_are_what_the_scheduler_runs(stack):
    pids = service_pids(stack)
    sched = pids["scheduler"]
    assert malloc.running(Path(f"/proc/{sched}/maps").read_text())[0] == "glibc"
    assert "malloc: glibc" in stack.logs()
    assert _status(sched, "Cpus_allowed_list") == str(CORE)
    environ = Path(f"/proc/{sched}/environ").read_bytes().split(b"\0")
    assert f"OMP_PLACES={{{CORE}}}".encode() in environ
    assert b"OMP_NUM_THREADS=1" in environ
    assert "OpenMP threads bound one per core" in stack.logs()
    if len(os.sched_getaffinity(0)) > 1:  # the other services keep every core
        assert _status(pids["gateway"], "Cpus_allowed_list") != str(CORE)
    r = requests.post(stack.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("value, message", [
    ("0-x", "argument --omp-threads-bind: '0-x' is not auto, none or a core list"),
    ("3-1", "argument --omp-threads-bind: '3-1' is not auto, none or a core list"),
    ("4096", "argument --omp-threads-bind: core 4096 is not one this process may run on"),
])
def test_bad_core_lists_are_start_up_errors_naming_the_flag(value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--omp-threads-bind", value], prog="tokenline serve")
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_bad_process_setup_before_loading_anything(tmp_path):
    # a missing model would be the error otherwise: these must come first
    missing = str(tmp_path / "no-such-model")
    cases = [
        (["--omp-threads-bind", str(CORE), "--num-threads", "2"],
         f"--num-threads 2 is more than the 1 cores of --omp-threads-bind {CORE}"),
    ]
    if malloc.find("jemalloc") is None:
        cases.append((["--malloc", "jemalloc"], "--malloc jemalloc: no jemalloc library found"))
    for flags, message in cases:
        run = subprocess.run([sys.executable, "-m", "tokenline.cli", "serve", "--model", missing,
                              *flags], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, run.stderr
        assert message in run.stderr
