"""Shared fixtures: the real nats-server, the real SmolLM2, a tiny random Llama, whole stacks."""

from __future__ import annotations

import os

# Triton kernels run on the CPU interpreter when there is no GPU; this must be set before any
# test module imports triton.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.helpers import make_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def smol_path():
    from common.modelstore import prepare_model

    return prepare_model(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_path):
    """A random-weight Llama with SmolLM2's tokenizer: fast enough for engine tests."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smol_path)


@pytest.fixture(scope="module")
def nats_server():
    from services.launcher.nats import NatsServer

    server = NatsServer().start()
    yield server
    server.stop()
