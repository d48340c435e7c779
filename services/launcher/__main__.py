"""`tokenline serve`: an embedded NATS server and the four services as supervised children."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request

from common.config import ServerArgs, parse_server_args, to_argv
from common.logging import configure, get_logger
from common.modelstore import prepare_model
from services.launcher.nats import NatsServer, cluster, die_with_parent, max_payload
from services.launcher.scheduler_env import bound_cores, scheduler_env

log = get_logger("launcher")

SERVICES = ("detokenizer", "tokenizer", "scheduler", "gateway")
RESTART_BACKOFF_S = (0.5, 1, 2, 4, 8)
# A child that keeps dying before the server was ever ready has a configuration problem (a bad
# flag, a model it cannot load), not bad luck: stop and say so instead of looping.
MAX_FAILED_STARTS = 3
# Handed to the children in their environment (TOKENLINE_<FLAG>), never on a command line that
# `ps` shows to every user of the machine.
SECRETS = ("nats_password", "nats_token", "api_key", "admin_api_key")


def _say(line: str, stream) -> None:
    """One write, newline included: the children write to the same file at the same time."""
    stream.write(line + "\n")
    stream.flush()


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                 cores: list[int] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.cores = cores  # its CPU affinity (None: the launcher's)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.next_start = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{self.name}", *self.argv],
            preexec_fn=self._before_exec, env=self.env,
        )

    def _before_exec(self) -> None:
        die_with_parent()
        if self.cores:
            os.sched_setaffinity(0, self.cores)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class NatsChild(Child):
    """An embedded nats-server node, supervised like the services. It comes back on the same
    ports, so every service's client reconnects by itself to the URLs it was given, and a
    cluster node rejoins its routes."""

    def __init__(self, server: NatsServer) -> None:
        super().__init__("nats-server", [])
        self.server = server
        self.proc = server.proc

    def start(self) -> None:
        try:
            self.server.start()
            log.info("embedded NATS server restarted", url=self.server.url)
        except (OSError, TimeoutError) as exc:  # e.g. the port was taken meanwhile: retried
            log.error("embedded NATS server did not start", url=self.server.url, error=str(exc))
        self.proc = self.server.proc


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.nats: list[NatsChild] = []
        self.children: list[Child] = []
        self.stopping = False
        self.ready = False
        self.failed: str | None = None

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        t0 = time.monotonic()
        args = self.args
        if error := check_nats_flags(args):  # before anything is loaded or started
            _say(f"tokenline serve: error: {error}", sys.stderr)
            return 2
        env = dict(os.environ)
        for name in SECRETS:
            if (value := getattr(args, name)) is not None:
                env["TOKENLINE_" + name.upper()] = value
        try:
            sched_env = scheduler_env(args, env)
        except ValueError as exc:
            _say(f"tokenline serve: error: {exc}", sys.stderr)
            return 2
        try:  # convert once, before the children
            prepare_model(self.args.model, self.args.cache_dir)
        except (OSError, ValueError) as exc:
            _say(f"tokenline serve: error: {exc}", sys.stderr)
            return 2
        if not args.nats_url:
            args = self._start_nats(args)
        argv = to_argv(dataclasses.replace(args, instance_id=None, **dict.fromkeys(SECRETS)))
        self.children = [Child(name, argv, sched_env if name == "scheduler" else env,
                               bound_cores(args) if name == "scheduler" else None)
                         for name in SERVICES]
        for child in self.children:
            child.start()
        url = f"http://{args.host}:{args.port}"
        try:
            while not self.stopping:
                self._supervise()
                if not self.ready and self._healthy(url):
                    self.ready = True
                    _say(f"tokenline ready at {url} ({time.monotonic() - t0:.1f}s)", sys.stdout)
                time.sleep(0.2)
        finally:
            self.shutdown()
        if self.failed:
            _say(f"tokenline serve: error: {self.failed}", sys.stderr)
            return 1
        return 0

    def _start_nats(self, args: ServerArgs) -> ServerArgs:
        """The embedded node(s); every service is given all of their URLs."""
        nodes = cluster(args.nats_cluster, user=args.nats_user, password=args.nats_password,
                        token=args.nats_token, payload=max_payload(args.max_request_bytes))
        try:
            for node in nodes:
                node.start()
        except (OSError, TimeoutError):
            for node in nodes:
                node.stop()
            raise
        self.nats = [NatsChild(node) for node in nodes]
        url = ",".join(node.url for node in nodes)
        log.info("embedded NATS server" if len(nodes) == 1 else "embedded NATS cluster", url=url,
                 monitoring=[n.monitor_port for n in nodes if n.monitor_port] or None)
        return dataclasses.replace(args, nats_url=url)

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def _supervise(self) -> None:
        now = time.monotonic()
        for child in [*self.nats, *self.children]:
            if child.alive() or self.stopping:
                continue
            if child.proc is not None and child.next_start == 0.0:
                code = child.proc.returncode
                if not self.ready and child.restarts + 1 >= MAX_FAILED_STARTS:
                    self.failed = (f"the {child.name} exited {child.restarts + 1} times (last "
                                   f"code {code}) before the server was ready; its output is "
                                   "above")
                    self.stopping = True
                    return
                delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
                log.warning(f"{child.name} exited; restarting", code=code, in_s=delay)
                child.next_start = now + delay
            if now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                child.start()

    def _healthy(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001
            return False

    def shutdown(self) -> None:
        for child in self.children:
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        for node in self.nats:  # last: the services leave cleanly while NATS still runs
            node.server.stop()


def check_nats_flags(args: ServerArgs) -> str | None:
    """What is wrong with the NATS flags, in one line naming the flag; None when nothing is."""
    if args.nats_cluster < 1:
        return f"--nats-cluster {args.nats_cluster}: at least 1 node"
    if args.nats_cluster > 1 and args.nats_url:
        return ("--nats-cluster starts local NATS nodes; with --nats-url the servers are yours "
                "(give every node's URL there, comma-separated)")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_server_args(argv, prog="tokenline serve")
    configure("launcher", args.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return Launcher(args).run()


if __name__ == "__main__":
    sys.exit(main())
