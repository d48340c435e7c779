"""The scheduler's resident weights per --quantization: int8 at most 35% of float32's, int4 at
most 20% (the real SmolLM2, each in a fresh process, as the scheduler service loads it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

# The model runner as the scheduler's engine core builds it, after everything it imports is
# loaded; the growth of the process's resident memory (anonymous and file pages) is what
# loading the model costs (the engine's other parts, the grammar compiler's tables say, are
# not weights). One KV block, so the pool is a rounding error.
SCRIPT = """
import gc, json, sys
from common.modelstore import gguf_source, prepare_model
from services.scheduler.attention.torch_backend import cpu_kernels
from services.scheduler.executor.model_runner import ModelRunner

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

path = prepare_model(None)
cpu_kernels()
before = rss()
runner = ModelRunner(path, device="cpu", dtype="float32", quantization=sys.argv[1],
                     gguf_path=gguf_source(None), max_total_tokens=16)
gc.collect()
info = runner.info()
print(json.dumps({"rss_growth": rss() - before, "weight_bytes": info["weight_bytes"],
                  "kv_bytes": info["kv_cache"]["bytes"], "quantization": info["quantization"]}))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict]:
    out = {}
    for q in ("none", "int8", "int4"):
        # the scheduler's own environment: huge pages for large tensors (its __main__ sets it)
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
        run = subprocess.run([sys.executable, "-c", SCRIPT, q], cwd=REPO, capture_output=True,
                             text=True, timeout=600, check=True, env=env)
        out[q] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def test_resident_weights_are_a_fraction_of_float32s(loaded):
    f32 = loaded["none"]["rss_growth"]
    print({q: round(v["rss_growth"] / 2**20) for q, v in loaded.items()})
    assert f32 > 500 << 20  # float32 SmolLM2: 108 MiB embedding + 513 MiB oneDNN copies
    assert loaded["int8"]["rss_growth"] <= 0.35 * f32
    assert loaded["int4"]["rss_growth"] <= 0.20 * f32


def test_reported_weight_bytes_are_what_is_resident(loaded):
    for q, got in loaded.items():
        # no hidden float copy: what the process grew by is the weights it reports, plus a
        # few MiB (rope tables, code pages, the model's objects)
        assert got["weight_bytes"] <= got["rss_growth"] <= got["weight_bytes"] + (48 << 20), q
    # every projection, and the embedding (the tied lm_head): the file's Q8_0
    assert loaded["int4"]["quantization"]["layers_from_file"] == 30 * 4 + 1
    assert loaded["int8"]["quantization"]["layers_from_file"] == 1
    assert loaded["int8"]["quantization"]["mode"] == "int8"
