"""NATS subject names, all under one prefix so deployments can share a cluster."""

from __future__ import annotations

from dataclasses import dataclass

TOKENIZER_QUEUE = "tokenizers"
SCHEDULER_QUEUE = "schedulers"


@dataclass(frozen=True)
class Subjects:
    prefix: str = "tl"

    @property
    def tokenizer(self) -> str:
        return f"{self.prefix}.tokenizer"

    @property
    def tokenize(self) -> str:
        """Any tokenizer (queue group, request/reply): token ids for /tokenize."""
        return f"{self.prefix}.tokenize"

    @property
    def scheduler(self) -> str:
        """Any scheduler (queue group): where new requests go."""
        return f"{self.prefix}.scheduler"

    def scheduler_instance(self, scheduler_id: str) -> str:
        """One scheduler: a request pinned to it (e.g. moved from a dead one)."""
        return f"{self.prefix}.scheduler.{scheduler_id}"

    def detokenizer(self, detokenizer_id: str) -> str:
        return f"{self.prefix}.detokenizer.{detokenizer_id}"

    def gateway(self, gateway_id: str) -> str:
        return f"{self.prefix}.gateway.{gateway_id}"

    @property
    def abort(self) -> str:
        return f"{self.prefix}.abort"

    @property
    def flush_cache(self) -> str:
        return f"{self.prefix}.control.flush_cache"

    @property
    def load_lora(self) -> str:
        return f"{self.prefix}.control.load_lora"

    @property
    def unload_lora(self) -> str:
        return f"{self.prefix}.control.unload_lora"

    def kv_events(self, scheduler_id: str = "*") -> str:
        """What enters and leaves one scheduler's prefix cache (`*`: every scheduler's)."""
        return f"{self.prefix}.kv_events.{scheduler_id}"

    def kv_snapshot(self, scheduler_id: str) -> str:
        return f"{self.prefix}.kv_snapshot.{scheduler_id}"

    def stats(self, service: str, instance_id: str) -> str:
        return f"{self.prefix}.stats.{service}.{instance_id}"

    def stats_all(self, service: str = "*") -> str:
        return f"{self.prefix}.stats.{service}.*"
