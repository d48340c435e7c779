"""The engine's LoRA adapters over its life: those of --lora-paths, those loaded at runtime
(/load_lora_adapter), and those being unloaded.

Unloading drains: the adapter takes no new request at once, the requests already using it
run to their end, and then it is dropped. A name being drained cannot be loaded again until
it is gone.

Called from the engine's thread only; `adapters` and `counts` are snapshots replaced whole,
so the service's heartbeat may read them from another thread.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from common.config import ServerArgs, lora_paths
from services.scheduler.executor.model_runner import ModelRunner


@dataclass
class LoraReply:
    """What a load or unload did: an HTTP status, a message naming the problem, its field."""

    status: int
    message: str
    param: str | None = None
    running: int = 0  # an unload: requests still using the adapter (dropped once they end)


NOT_ENABLED = LoraReply(400, "LoRA is not enabled on this server: start it with --enable-lora "
                             "(or --lora-paths)", "lora_path")


class LoraAdmin:
    def __init__(self, runner: ModelRunner, args: ServerArgs, base_name: str) -> None:
        self.runner, self.base_name = runner, base_name
        self.max_loras = args.max_loras_per_batch
        self.draining: set[str] = set()
        # forgets an unloaded adapter's cached KV blocks (the engine's pool sets it): the
        # block hashes fold in the adapter's name, and a name may come back with other weights
        self.forget_cached: Callable[[str], int] = lambda name: 0
        self.version = time.time_ns()  # of the last change: the newest view of a peer wins
        self.adapters: dict[str, str] = {}  # served: name -> path (draining ones left out)
        self.counts: tuple[dict[str, int], dict[str, int]] = ({}, {})  # running, waiting
        if args.enable_lora or args.lora_paths:
            # every adapter read once now, so a bad one stops the start naming it
            runner.enable_lora({n: Path(p) for n, p in lora_paths(args).items()},
                               args.max_lora_rank, args.max_loras_per_batch)
            self._changed()

    @property
    def enabled(self) -> bool:
        return self.runner.lora is not None

    def refusal(self, name: str | None) -> str | None:
        """Why a new request may not use adapter `name` (None: it may)."""
        if name is None or name in self.adapters:
            return None
        if name in self.draining:
            return f"LoRA adapter {name!r} is being unloaded"
        return f"LoRA adapter {name!r} is not served here (--lora-paths, /load_lora_adapter)"

    def load(self, name: str, path: str) -> LoraReply:
        """Read, validate and serve adapter `name` from `path`; a 400 naming the problem
        leaves everything as it was."""
        if not self.enabled:
            return NOT_ENABLED
        if name == self.base_name:
            return LoraReply(400, f"LoRA adapter name {name!r} is the base model's name",
                             "lora_name")
        if name in self.draining:
            return LoraReply(400, f"LoRA adapter {name!r} is still being unloaded (requests "
                                  "using it are running); load it again once they end",
                             "lora_name")
        if name in self.adapters:
            return LoraReply(400, f"LoRA adapter {name!r} is already loaded", "lora_name")
        assert self.runner.lora is not None
        try:
            self.runner.lora.add(name, Path(path))
        except ValueError as e:
            return LoraReply(400, str(e), "lora_path")
        self._changed()
        return LoraReply(200, f"LoRA adapter {name!r} loaded")

    def unload(self, name: str, users: Iterable[str | None]) -> LoraReply:
        """Stop taking requests for `name`; drop it now if none of `users` (the live
        requests' adapters) uses it, else once they end (`drop_drained`)."""
        if not self.enabled:
            return NOT_ENABLED
        if name not in self.adapters:
            return LoraReply(404, f"The LoRA adapter `{name}` does not exist"
                             + (" (it is being unloaded)" if name in self.draining else ""),
                             "lora_name")
        self.draining.add(name)
        self._changed()
        n = Counter(users)[name]
        if n == 0:
            self.drop_drained([])
            return LoraReply(200, f"LoRA adapter {name!r} unloaded")
        return LoraReply(200, f"LoRA adapter {name!r} unloading: it takes no new request, "
                              f"and is dropped once its {n} running request(s) end", running=n)

    def drop_drained(self, users: Iterable[str | None]) -> list[str]:
        """Drop the draining adapters none of `users` uses any more; their names."""
        assert self.runner.lora is not None
        done = sorted(self.draining - set(users))
        for name in done:
            self.runner.lora.remove(name)
            self.draining.discard(name)
            self.forget_cached(name)
        return done

    def count(self, running: Iterable[str | None], waiting: Iterable[str | None]) -> None:
        """The requests per adapter, running and waiting (for the heartbeat's metrics)."""
        self.counts = ({n: c for n, c in Counter(running).items() if n is not None},
                       {n: c for n, c in Counter(waiting).items() if n is not None})

    def _changed(self) -> None:
        assert self.runner.lora is not None
        self.adapters = {n: str(p) for n, p in self.runner.lora.paths.items()
                         if n not in self.draining}
        self.version = time.time_ns()

    def stats(self) -> dict:
        if not self.enabled:
            return {}
        running, waiting = self.counts
        return dict(lora_adapters=self.adapters, lora_version=self.version,
                    lora_running=running, lora_waiting=waiting, max_lora=self.max_loras)
