"""Chat templates come from the model's own files; a model without one renders no chat (a
clear error naming --chat-template) unless --chat-template FILE gives one."""

from __future__ import annotations

import json
import shutil

import pytest

from common.modelstore import model_info
from services.tokenizer.tokenize import InputError, TextTokenizer

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def base_model(tiny_model_dir, tmp_path):
    """The tiny Llama with its chat template taken out, as a base model ships."""
    path = tmp_path / "base"
    shutil.copytree(tiny_model_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_the_models_own_template_is_used(tiny_model_dir):
    info = model_info(tiny_model_dir)
    assert info.chat_template and info.architecture == "LlamaForCausalLM"
    assert "<|im_start|>user\nHi<|im_end|>" in TextTokenizer(info).apply_chat_template(HI)


def test_no_template_is_an_input_error_naming_the_flag(base_model):
    info = model_info(base_model)
    assert info.chat_template is None
    with pytest.raises(InputError, match="no chat template.*--chat-template FILE"):
        TextTokenizer(info).apply_chat_template(list(HI))


def test_chat_template_file_gives_one(base_model, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    info = model_info(base_model, chat_template=str(template))
    assert TextTokenizer(info).apply_chat_template(list(HI)) == "[user] Hi\n[assistant] "
