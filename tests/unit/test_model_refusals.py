"""A model the engine does not implement is refused at start with one line naming what it
lacks: an unknown architecture, an unsupported rope scaling, soft-capping, mixture-of-experts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from common.modelstore import architecture
from tests.helpers import REPO


def _variant(tiny_model_dir, tmp_path, **changes):
    path = tmp_path / "variant"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenline.cli", "serve", "--port", "0", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("changes, line", [
    (dict(architectures=["MixtralForCausalLM"], model_type="mixtral"),
     "tokenline serve: error: unsupported architecture 'MixtralForCausalLM' (model_type "
     "'mixtral'): tokenline runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
     "Qwen3ForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
     "tokenline serve: error: unsupported model config for LlamaForCausalLM: rope_parameters "
     "type 'yarn' (rope scaling implemented: default, linear, llama3)"),
])
def test_serve_refuses_what_the_engine_does_not_implement(tiny_model_dir, tmp_path, changes,
                                                          line):
    out = _serve("--model", str(_variant(tiny_model_dir, tmp_path, **changes)))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [line]
    assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize("changes, words", [
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0]}),
     "rope_scaling type 'longrope'"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(num_local_experts=8), "num_local_experts=8 (mixture-of-experts"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(hidden_act="relu"), "activation 'relu'"),
])
def test_config_fields_are_refused_by_name(changes, words):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **changes}
    with pytest.raises(ValueError, match="unsupported model config") as exc:
        architecture(config)
    assert words in str(exc.value)


def test_model_type_alone_picks_the_family():
    assert architecture({"model_type": "gemma3_text"}) == "Gemma3ForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture None .model_type 'gpt2'"):
        architecture({"model_type": "gpt2"})
