"""Bad configuration gets one clear line and a non-zero exit, from a flag or its environment
variable alike; `tokenline serve` stops instead of restarting a service that cannot start."""

from __future__ import annotations

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
])
def test_bad_flags_and_environment_are_usage_errors(argv, env, message, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        parse_server_args(argv, prog="tokenline serve")
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


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
