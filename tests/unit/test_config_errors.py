"""Bad configuration gets one clear line and a non-zero exit, from a flag or its environment
variable alike; `tokenline serve` stops instead of restarting a service that cannot start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.config import parse_server_args
from tests.helpers import REPO


@pytest.mark.parametrize("argv, env, message", [
    (["--dtype", "fp8"], {}, "argument --dtype: invalid choice: 'fp8'"),
    (["--device", "gpu"], {}, "argument --device: 'gpu' is not auto, cpu, cuda or cuda:N"),
    ([], {"TOKENLINE_PAGE_SIZE": "big"}, "TOKENLINE_PAGE_SIZE='big': expected an int"),
    ([], {"TOKENLINE_BATCHING": "eager"}, "TOKENLINE_BATCHING='eager': choose from continuous"),
    ([], {"TOKENLINE_DEVICE": "cuda:x"}, "TOKENLINE_DEVICE='cuda:x': 'cuda:x' is not auto"),
    (["--log-level", "verbose"], {}, "argument --log-level: invalid choice: 'verbose'"),
    ([], {"TOKENLINE_LOG_LEVEL": "trace"}, "TOKENLINE_LOG_LEVEL='trace': choose from debug"),
    (["--lora-paths", "pirate"], {}, "--lora-paths: 'pirate' is not name=path"),
    (["--lora-modules", "a=/x", "a=/y"], {}, "--lora-paths: adapter name 'a' given twice"),
    (["--max-loras-per-batch", "0"], {}, "--max-loras-per-batch must be >= 1, not 0"),
])
def test_bad_flags_and_environment_are_usage_errors(argv, env, message, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        parse_server_args(argv, prog="tokenline serve")
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_lora_paths_from_either_spelling_or_the_environment(monkeypatch):
    from common.config import lora_paths, to_argv

    args = parse_server_args(["--lora-modules", "a=/x", "b=/y"])
    assert lora_paths(args) == {"a": "/x", "b": "/y"}
    assert parse_server_args(to_argv(args)).lora_paths == ["a=/x", "b=/y"]
    monkeypatch.setenv("TOKENLINE_LORA_PATHS", "c=/z d=/w")
    assert lora_paths(parse_server_args([])) == {"c": "/z", "d": "/w"}


def test_good_values_pass(monkeypatch):
    monkeypatch.setenv("TOKENLINE_DTYPE", "bfloat16")
    args = parse_server_args(["--device", "cuda:1"])
    assert (args.device, args.dtype) == ("cuda:1", "bfloat16")


def test_offline_engine_checks_its_flags_before_loading_anything():
    from tokenline.offline import _server_args

    with pytest.raises(ValueError, match="device: 'tpu'"):
        _server_args(None, {"device": "tpu"})
    with pytest.raises(ValueError, match="dtype='fp8'"):
        _server_args(None, {"dtype": "fp8"})


def _serve(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenline.cli", "serve", "--port", "0", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, message", [
    (["--nats-cluster", "0"], "--nats-cluster 0: at least 1 node"),
    (["--nats-cluster", "3", "--nats-url", "nats://127.0.0.1:4222"],
     "--nats-cluster starts local NATS nodes; with --nats-url the servers are yours"),
])
def test_serve_refuses_a_nats_cluster_it_cannot_start(flags, message):
    done = _serve(*flags, timeout=60)
    assert done.returncode == 2 and f"tokenline serve: error: {message}" in done.stderr, \
        done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_serve_with_a_missing_model_says_so_and_exits():
    out = _serve("--model", "/nonexistent/model.gguf")
    assert out.returncode == 2
    assert "tokenline serve: error: model not found: /nonexistent/model.gguf" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_gives_up_on_a_service_that_cannot_start(smol_path):
    # no room for the KV cache: the scheduler says why, once per try, then serve stops
    out = _serve("--cpu-memory-gib", "0.01")
    assert out.returncode == 1
    assert "the scheduler exited 3 times (last code 1) before the server was ready" in out.stderr
    logs = out.stdout + out.stderr
    assert logs.count('"event": "cannot start"') == 3 and "no room for a KV cache" in logs
    assert "Traceback" not in logs


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
ALL_CORES = {0, 1}


@pytest.mark.parametrize("argv, running, environ, affinity, message", [
    (["--malloc", "tcmalloc"], ("glibc", None), {}, ALL_CORES,
     "--malloc tcmalloc: this scheduler runs glibc's malloc; only `tokenline serve` sets that "
     "up, before the process starts; started alone, set LD_PRELOAD"),
    (["--malloc", "jemalloc"], ("tcmalloc", TCMALLOC), {}, ALL_CORES,
     "--malloc jemalloc: this scheduler runs tcmalloc"),
    (["--malloc", "system"], ("tcmalloc", TCMALLOC), {}, ALL_CORES,
     f"--malloc system: this scheduler runs tcmalloc ({TCMALLOC}), preloaded by LD_PRELOAD; "
     "unset it, or use --malloc auto"),
    (["--omp-threads-bind", "auto"], ("glibc", None), {}, ALL_CORES,
     "--omp-threads-bind auto: only `tokenline serve` sets that up, before the process starts; "
     "started alone, set OMP_PLACES={0},{1} OMP_PROC_BIND=close and its CPU affinity (taskset "
     "-c 0-1) in its environment, or leave the flag at none"),
    # places given, but the process may run off the named core
    (["--omp-threads-bind", "0"], ("glibc", None), {"OMP_PLACES": "{0}"}, ALL_CORES,
     "--omp-threads-bind 0: only `tokenline serve` sets that up"),
])
def test_a_scheduler_refuses_process_setup_it_was_not_started_with(
        argv, running, environ, affinity, message, monkeypatch):
    from services.scheduler import process_setup

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: affinity)  # the core list's check
    with pytest.raises(ValueError) as exc:
        process_setup.check(parse_server_args(argv), running, environ, affinity)
    assert message in str(exc.value)


@pytest.mark.parametrize("argv, running, environ, affinity", [
    ([], ("glibc", None), {}, ALL_CORES),  # the defaults: compose's scheduler
    ([], ("tcmalloc", TCMALLOC), {"OMP_PLACES": "{0}"}, {0}),  # auto is what runs
    (["--malloc", "system"], ("glibc", None), {}, ALL_CORES),
    (["--malloc", "tcmalloc"], ("tcmalloc", TCMALLOC), {}, ALL_CORES),
    # as `tokenline serve --omp-threads-bind 0` starts its scheduler, or taskset would
    (["--omp-threads-bind", "0"], ("glibc", None), {"OMP_PLACES": "{0}"}, {0}),
    (["--omp-threads-bind", "auto"], ("glibc", None), {"OMP_PLACES": "{0},{1}"}, ALL_CORES),
])
def test_a_scheduler_accepts_the_defaults_and_what_it_runs(argv, running, environ, affinity,
                                                           monkeypatch):
    from services.scheduler import process_setup

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: ALL_CORES)
    process_setup.check(parse_server_args(argv), running, environ, affinity)


def test_a_scheduler_started_alone_says_which_flag_it_cannot_honour():
    env = {k: v for k, v in os.environ.items() if k not in (
        "LD_PRELOAD", "OMP_PLACES", "TOKENLINE_MALLOC", "TOKENLINE_OMP_THREADS_BIND")}
    for flags, message in [
        (["--malloc", "tcmalloc"], "--malloc tcmalloc: this scheduler runs glibc's malloc"),
        (["--omp-threads-bind", "auto"], "--omp-threads-bind auto: only `tokenline serve`"),
    ]:
        out = subprocess.run([sys.executable, "-m", "services.scheduler", *flags], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr
        lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
        assert len(lines) == 1 and '"event": "cannot start"' in lines[0], lines
        assert message in lines[0]


def test_serve_refuses_system_malloc_under_a_preloaded_one():
    from services.launcher.scheduler_env import scheduler_env

    with pytest.raises(ValueError, match="--malloc system: LD_PRELOAD loads tcmalloc"):
        scheduler_env(parse_server_args(["--malloc", "system"]), {"LD_PRELOAD": TCMALLOC})
