"""One file per model family over the shared decoder in layers.py; `model_class` picks one."""

from __future__ import annotations

from common.modelstore import ARCHITECTURES, architecture
from services.scheduler.models.gemma3 import Gemma3ForCausalLM
from services.scheduler.models.layers import CausalLM
from services.scheduler.models.llama import LlamaForCausalLM
from services.scheduler.models.mistral import MistralForCausalLM
from services.scheduler.models.phi3 import Phi3ForCausalLM
from services.scheduler.models.qwen2 import Qwen2ForCausalLM
from services.scheduler.models.qwen3 import Qwen3ForCausalLM

FAMILIES: dict[str, type[CausalLM]] = {cls.__name__: cls for cls in (
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM,
    Gemma3ForCausalLM,
)}
assert set(FAMILIES) == set(ARCHITECTURES), "modelstore.ARCHITECTURES lists what runs here"


def model_class(config: dict) -> type[CausalLM]:
    """The family class for a config, from its `architectures` (or `model_type`); a ValueError
    naming the architecture or config field this engine does not implement otherwise."""
    return FAMILIES[architecture(config)]
