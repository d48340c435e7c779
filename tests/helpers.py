"""Test helpers: a tiny model, an in-process engine, and whole stacks in subprocesses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_tiny_llama(target: Path, tokenizer_from: Path, **overrides) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
               rope_theta=10000.0)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    with torch.no_grad():  # larger weights than the default init: logits far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(target, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, target / name)
    return target


def engine_args(model: Path, **kw):
    from common.config import ServerArgs

    kw.setdefault("max_total_tokens", 8192)
    return ServerArgs(model=str(model), **kw)


def run_engine(engine, reqs, max_steps: int = 100000):
    """Drive an EngineCore until idle; returns rid -> (token ids, finish) and the step count."""
    tokens: dict[str, list[int]] = {r.rid: [] for r in reqs}
    finish = {}
    for r in reqs:
        engine.submit(r)
    steps = 0
    while engine.has_work() and steps < max_steps:
        for out in engine.step():
            tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish is not None:
                finish[out.rid] = out.finish
        steps += 1
    return tokens, finish, steps


def free_port() -> int:
    from services.launcher.nats import free_port as fp

    return fp()


class Stack:
    """`tokenline serve` in a subprocess, with its own embedded NATS server."""

    def __init__(self, *flags: str, env: dict | None = None, timeout: float = 120) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = list(flags)
        self.env = {**os.environ, **(env or {})}
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tokenline-stack-{self.port}.log"

    def start(self) -> Stack:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenline.cli", "serve", "--port", str(self.port),
             *self.flags],
            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_healthy(self.url, self.timeout, self.proc, self.log_path)
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(url: str, timeout: float, proc=None, log_path=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = Path(log_path).read_text(errors="replace")[-3000:] if log_path else ""
            raise RuntimeError(f"stack exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus text, parsed with prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)
