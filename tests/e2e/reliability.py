"""What the hardening tests share: HTTP calls, the error shape, the books after a test, and the
stack's service processes (to kill them)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import requests

from tests.helpers import Stack, metric

SERVICES = ("tokenizer", "scheduler", "detokenizer", "gateway")
STAGES = ("tokenizer", "scheduler", "detokenizer")


def tiny_stack(model_dir: Path, *flags: str, max_model_len: int = 256,
               env: dict | None = None) -> Stack:
    """A stack of the tiny random Llama: quick to start, quick to generate with (it seldom
    samples EOS, so a request without max_tokens runs to the context length: keep that short)."""
    return Stack("--model", str(model_dir), "--served-model-name", "tiny",
                 "--max-model-len", str(max_model_len), "--max-total-tokens", "16384",
                 "--stats-interval", "0.25", *flags, env=env)


def assert_openai_error(resp: requests.Response, status: int, param: str | None = "",
                        *contains: str) -> dict:
    """`resp` is `status` with OpenAI's error body; `param` as given ("" = don't care)."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers["Content-Type"].startswith("application/json"), resp.headers
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param != "":
        assert err["param"] == param, err
    for text in contains:
        assert text in err["message"], err
    return err


def metrics(url: str) -> str:
    return requests.get(url + "/metrics", timeout=10).text


def books(url: str) -> dict[str, float]:
    """KV blocks and per-request state, as /metrics has them."""
    text = metrics(url)
    out = {"free": metric(text, "tokenline:kv_cache_free_blocks"),
           "total": metric(text, "tokenline:kv_cache_total_blocks")}
    for svc in ("gateway", *STAGES):
        out[svc] = metric(text, "tokenline:requests_in_flight", service=svc)
    return out


def assert_books_balance(url: str, headers: dict | None = None, timeout: float = 20) -> dict:
    """Once idle and the prefix cache is flushed, every KV block is free and no service holds
    a request. Heartbeats lag by --stats-interval, so poll."""
    deadline = time.monotonic() + timeout
    while True:
        flushed = requests.post(url + "/flush_cache", headers=headers, timeout=10)
        b = books(url)
        leaks = {k: v for k, v in b.items() if k not in ("free", "total") and v}
        if flushed.ok and b["total"] > 0 and b["free"] == b["total"] and not leaks:
            return b
        if time.monotonic() > deadline:
            raise AssertionError(f"books do not balance: {b} (flush: {flushed.status_code} "
                                 f"{flushed.text[:200]})")
        time.sleep(0.25)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def service_pids(stack: Stack) -> dict[str, int]:
    """The launcher's children by the name `ps` shows (`python -m services.<name>`)."""
    assert stack.proc is not None
    found = {}
    for pid in _children(stack.proc.pid):
        argv = cmdline(pid)
        for name in SERVICES:
            if f"services.{name}" in argv:
                found[name] = pid
    return found


def nats_pid(stack: Stack) -> int:
    """The nats-server this stack's launcher started (its own child: never another stack's)."""
    assert stack.proc is not None
    found = [pid for pid in _children(stack.proc.pid)
             if os.path.basename(cmdline(pid)[0]) == "nats-server"]
    assert len(found) == 1, found
    return found[0]


def kill9(stack: Stack, name: str) -> int:
    pid = service_pids(stack)[name]
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_restarted(stack: Stack, name: str, old_pid: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = service_pids(stack).get(name)
        if pid is not None and pid != old_pid:
            return pid
        time.sleep(0.1)
    raise AssertionError(f"{name} was not restarted within {timeout}s:\n{stack.logs()[-3000:]}")


# -- clients that record what a user would see -------------------------------------------------
@dataclass
class Outcome:
    """One request as its client saw it: an HTTP status, then (streaming) what came."""

    status: int
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    error: dict | None = None  # OpenAI's error object: the body's, or a stream's error event
    elapsed: float = 0.0
    first_chunk_s: float | None = None
    retry_after: str | None = None
    done: bool = False  # the stream ended with `data: [DONE]`
    ended_at: float = 0.0  # time.monotonic() when the answer was complete

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish is not None


async def complete(session: aiohttp.ClientSession, url: str, body: dict,
                   headers: dict | None = None, started: asyncio.Event | None = None,
                   timeout: float = 60) -> Outcome:
    """POST /v1/completions; streaming when `body` says so. `timeout` seconds with nothing
    from the server (no answer, no chunk) is a hang, past every deadline the gateway keeps:
    it is reported as status 0, which no test accepts. A slow stream that keeps coming, as on
    a loaded machine, is not one."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout) as idle:
            out = await _complete(session, url, body, headers, started, t0, idle, timeout)
    except TimeoutError:
        out = Outcome(0, error={"message": f"nothing for {timeout}s (a hang)"},
                      elapsed=time.monotonic() - t0)
    out.ended_at = time.monotonic()
    return out


async def _complete(session, url, body, headers, started, t0, idle, timeout) -> Outcome:
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        out = Outcome(resp.status, retry_after=resp.headers.get("Retry-After"))
        if resp.status != 200 or not body.get("stream"):
            data = await resp.json(content_type=None)
            out.elapsed = time.monotonic() - t0
            if resp.status != 200:
                out.error = data["error"]
            else:
                out.text = data["choices"][0]["text"]
                out.finish = data["choices"][0]["finish_reason"]
                out.completion_tokens = data["usage"]["completion_tokens"]
            return out
        async for raw in resp.content:
            idle.reschedule(asyncio.get_running_loop().time() + timeout)
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                out.done = True
                break
            event = json.loads(data)
            if "error" in event:
                out.error = event["error"]
                continue
            if out.first_chunk_s is None:
                out.first_chunk_s = time.monotonic() - t0
                if started is not None:
                    started.set()
            for choice in event["choices"]:
                out.text += choice["text"]
                out.finish = choice["finish_reason"] or out.finish
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
        out.elapsed = time.monotonic() - t0
        return out


def assert_ended_cleanly(out: Outcome, max_tokens: int) -> None:
    """Finished in full, or a clear OpenAI-style error: never a hang (status 0: `complete`
    heard nothing for longer than any deadline of the gateway) or a torn body."""
    assert out.status != 0, out
    if out.ok:
        assert out.finish == "length" and out.completion_tokens == max_tokens, out
        return
    assert out.error is not None, out
    assert set(out.error) == {"message", "type", "param", "code"}, out
    if out.status == 200:  # an error mid-stream is an SSE event, then [DONE]
        assert out.done, out
    else:
        assert out.status in (503, 504), out  # "retry later", never a crash


# -- many greedy streams through a NATS failure ----------------------------------------------
IN_FLIGHT = 64
MAX_TOKENS = 40


@dataclass
class Run:
    """One stream as its client saw it."""

    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    error: dict | None = None
    chunk_times: list[float] = field(default_factory=list)

    @property
    def pause(self) -> float:
        """The longest wait between two chunks."""
        t = self.chunk_times
        return max((b - a for a, b in zip(t, t[1:], strict=False)), default=0.0)


async def stream(session: aiohttp.ClientSession, url: str, i: int,
                 started: asyncio.Event, max_tokens: int = MAX_TOKENS) -> Run:
    body = {"prompt": f"Request {i}: the quick brown fox", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    run = Run()
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: "):])
            run.chunk_times.append(time.monotonic())
            if "error" in event:
                run.error = event["error"]
                continue
            for choice in event["choices"]:
                run.text += choice["text"]
                run.finish = choice["finish_reason"] or run.finish
                started.set()
            if event.get("usage"):
                run.completion_tokens = event["usage"]["completion_tokens"]
    return run


async def _load(url: str, kill=None, max_tokens: int = MAX_TOKENS) -> list[Run]:
    """IN_FLIGHT streams; once each has its first tokens, `kill()`."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = [asyncio.Event() for _ in range(IN_FLIGHT)]
        tasks = [asyncio.create_task(stream(session, url, i, ev, max_tokens))
                 for i, ev in enumerate(started)]
        if kill is not None:
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
            await asyncio.get_running_loop().run_in_executor(None, kill)
        return list(await asyncio.gather(*tasks))


def under_load(url: str, kill=None, max_tokens: int = MAX_TOKENS) -> list[Run]:
    """IN_FLIGHT greedy streams of `max_tokens` tokens; once each has its first tokens, `kill()`
    (in a thread: it may sleep). The client may read its first tokens late, when a loaded
    machine starves it: a fault that must hit streams still being generated needs long ones."""
    return asyncio.run(_load(url, kill, max_tokens))


def check_identical(runs: list[Run], reference: list[str], what: str,
                    max_tokens: int = MAX_TOKENS) -> None:
    """64/64 identical to the uninterrupted run, each with every token once; the pauses said."""
    for i, (run, want) in enumerate(zip(runs, reference, strict=True)):
        assert run.error is None, (what, i, run.error)
        assert run.finish == "length" and run.completion_tokens == max_tokens, (what, i, run)
        assert run.text == want, (what, i, run.text, want)
    pauses = sorted(r.pause for r in runs)
    print(f"{what}: {len(runs)}/{IN_FLIGHT} identical; stream pause per request: median "
          f"{statistics.median(pauses):.2f}s, max {pauses[-1]:.2f}s")




def resumed(url: str) -> dict[str, float]:
    """Requests the gateway resumed so far, by why (failover.py's reasons)."""
    text = metrics(url)
    return {why: metric(text, "tokenline:requests_resumed_total", reason=why)
            for why in ("gap", "stalled", "scheduler_lost")}
