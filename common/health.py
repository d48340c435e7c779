"""Container health check: `python -m common.health [--http]` exits 0 while the service lives.

Every service touches `--health-file` after each heartbeat it publishes while connected to
NATS, so a file older than `--heartbeat-timeout` means the service is stuck or cut off. With
`--http` (the gateway) it also asks the gateway's `/health`, which answers 200 only while a
tokenizer, a scheduler and a detokenizer are alive behind it. Flags and `TOKENLINE_*`
variables are the service's own, so the check reads the same configuration as the service.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request

from common.config import ServerArgs, add_server_args


def check(args: ServerArgs, http: bool) -> str | None:
    """None when healthy, else why not."""
    if args.health_file:
        try:
            age = time.time() - os.stat(args.health_file).st_mtime
        except FileNotFoundError:
            return f"no heartbeat yet ({args.health_file} missing)"
        limit = max(args.heartbeat_timeout, 2 * args.stats_interval)
        if age > limit:
            return f"last heartbeat {age:.1f}s ago (limit {limit:.1f}s)"
    if http:
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        try:
            with urllib.request.urlopen(f"http://{host}:{args.port}/health", timeout=3) as r:
                if r.status != 200:
                    return f"/health answered {r.status}"
        except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
            return f"/health: {exc}"
    if not args.health_file and not http:
        return "nothing to check: set --health-file (TOKENLINE_HEALTH_FILE) or --http"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.health")
    add_server_args(parser)
    parser.add_argument("--http", action="store_true", help="also GET the gateway's /health")
    ns = vars(parser.parse_args(argv))
    http = ns.pop("http")
    problem = check(ServerArgs(**ns), http)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
