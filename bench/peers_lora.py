"""LoRA in `tokenline bench peers`: N PEFT adapters served beside the base by ours and by vLLM.

    tokenline bench peers --peer vllm --lora-adapters 4 --lora-rank 16 --rounds 3

The adapters are made with peft by `bench.lora` (or taken from `--lora-dir`, where they are
kept for the next run), every server starts fresh for each pass with all of them loaded
(ours: `--lora-paths name=path ... --max-loras-per-batch N --max-lora-rank R`; vLLM:
`--enable-lora --lora-modules name=path ... --max-loras N --max-lora-rank R'`, R' the least
rank vLLM accepts that is at least R), and each pass sends the workload twice, the order
alternating by round: every request to the base, and request i to adapter i % N (by `model`).
The prefix cache is flushed before each (vLLM's route for it needs VLLM_SERVER_DEV_MODE=1).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM 0.32's --max-lora-rank takes only these (vllm/config/lora.py, MaxLoRARanks)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
BASE = "base"
ADAPTERS = "adapters"



def add_lora_args(p: argparse.ArgumentParser) -> None:
    """`bench peers`' LoRA flags."""
    p.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="serve N PEFT adapters (made with peft, as `bench lora --adapters`) "
                   "beside the base in ours and vLLM, and send the workload to the base and "
                   "spread over them (default 0: no adapters)")
    p.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank (default 16)")
    p.add_argument("--lora-dir", help="keep the adapters here and reuse those already made "
                   "for this model and rank (default: a temporary directory)")

def vllm_rank(rank: int) -> int:
    """The least rank vLLM's --max-lora-rank accepts that holds adapters of rank `rank`."""
    for allowed in VLLM_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"--lora-rank {rank}: vLLM takes ranks up to {VLLM_RANKS[-1]}")


@dataclass
class LoraSetup:
    """The adapters every server serves: name -> PEFT directory, all of rank `rank`."""

    paths: dict[str, Path]
    rank: int

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def ours_flags(self) -> list[str]:
        return ["--lora-paths", *(f"{n}={p}" for n, p in self.paths.items()),
                "--max-loras-per-batch", str(len(self.paths)), "--max-lora-rank", str(self.rank)]

    def vllm_flags(self) -> list[str]:
        return ["--enable-lora", "--max-loras", str(len(self.paths)),
                "--max-lora-rank", str(vllm_rank(self.rank)),
                "--lora-modules", *(f"{n}={p}" for n, p in self.paths.items())]


@contextmanager
def lora_setup(model: Path, count: int, rank: int, directory: str | None
               ) -> Iterator[LoraSetup | None]:
    """`count` adapters of rank `rank` for `model` (None when `count` is 0): those already in
    `directory` for this model and rank, else made there (in a temporary one by default)."""
    if count == 0:
        yield None
        return
    from bench.lora import adapters_at
    from common.modelstore import prepare_model

    model_dir = prepare_model(str(model))  # peft reads a transformers directory
    with tempfile.TemporaryDirectory(prefix="tokenline-peers-lora-") as tmp:
        out = Path(directory or tmp)
        out.mkdir(parents=True, exist_ok=True)
        yield LoraSetup(adapters_at(model_dir, out, count, rank), rank)


def _medians(runs: list[Any]) -> dict[tuple[str, str], tuple[float, float, int, int]]:
    """(system, workload) -> median tok/s, median TPOT p50, most short requests, rounds."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for r in runs:
        groups.setdefault((r.system, r.extra["workload"]), []).append(r)
    return {k: (statistics.median(r.tokens_per_s for r in rs),
                statistics.median(r.median_tpot_ms for r in rs),
                max(r.short_requests for r in rs), len(rs)) for k, rs in groups.items()}


def format_lora_report(runs: list[Any], header: str, ours: str) -> str:
    """Per system: the base's and the adapters' useful tok/s (medians over rounds), adapters
    over base, TPOT p50 of each; then ours over each peer, on the adapters and on the base."""
    med = _medians(runs)
    systems = list(dict.fromkeys(r.system for r in runs))
    lines = [header, "",
             f"{'system':34} {'base tok/s':>10} {'adapters tok/s':>14} {'adapters/base':>13} "
             f"{'TPOT p50 ms base/adapters':>26} {'short':>6} {'rounds':>6}"]
    for s in systems:
        base, lora = med[(s, BASE)], med[(s, ADAPTERS)]
        lines.append(f"{s:34} {base[0]:10.1f} {lora[0]:14.1f} {lora[0] / base[0]:13.2f} "
                     f"{f'{base[1]:.1f} / {lora[1]:.1f}':>26} {max(base[2], lora[2]):6d} "
                     f"{min(base[3], lora[3]):6d}")
    if ours in systems:
        for peer in (s for s in systems if s != ours):
            lines.append(f"\n{ours} / {peer}: "
                         f"{med[(ours, ADAPTERS)][0] / med[(peer, ADAPTERS)][0]:.2f}x the tok/s "
                         f"on the adapters, {med[(ours, BASE)][0] / med[(peer, BASE)][0]:.2f}x "
                         "on the base")
    return "\n".join(lines)
