"""tokenline: LLM serving over NATS. `from tokenline import Engine` for offline batch work."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenline.offline import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":  # lazy: importing the package must not pull in torch
        from tokenline.offline import Engine

        return Engine
    raise AttributeError(name)
