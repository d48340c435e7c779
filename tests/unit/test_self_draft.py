"""The self-speculative draft (SELF) runs the target's first L layers, its final norm and its
head, from the target's own modules, into a KV cache of its own: its logits are transformers'
hidden state after layer L through that norm and head, in float64."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.config import ServerArgs
from services.scheduler.core.draft import DraftSeq, self_draft_proposer
from services.scheduler.core.kv_pool import BlockPool
from services.scheduler.executor.model_runner import ModelRunner
from tests.helpers import make_tiny_llama

IDS = [1000 + 7 * i for i in range(40)]


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory, smol_path):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-3"), smol_path, num_hidden_layers=3)


def _reference(path, ids: list[int], layers: int) -> torch.Tensor:
    """The logits after `layers` layers: transformers' hidden state there (before its final
    norm), through the final norm and lm_head, all in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layers][0]
        return model.lm_head(model.model.norm(hidden))


@pytest.mark.parametrize("layers", [1, 2])
def test_the_draft_runs_only_its_first_layers_then_the_head(three_layers, layers):
    target = ModelRunner(three_layers, max_total_tokens=512, device="cpu", dtype="float32")
    draft = target.first_layers(layers, 256)
    assert draft.model is target.model and draft.num_layers == layers
    assert len(draft.kv_caches) == layers and draft.num_blocks == 16
    assert all(d[0] is not t[0] for d, t in zip(draft.kv_caches, target.kv_caches[:layers],
                                                strict=True))  # a KV cache of its own
    pool = BlockPool(draft.num_blocks, draft.page_size, enable_prefix_cache=False)
    seq = DraftSeq(IDS[:-1], [], block_table=pool.allocate(3))
    prompt = draft.forward([seq], [len(IDS) - 1], [len(IDS) - 1])  # every position's logits
    seq.num_computed = len(IDS) - 1
    seq.output_ids.append(IDS[-1])
    last = draft.forward([seq], [1], [1])  # a decode step over the draft's own KV
    ours = torch.cat([prompt, last]).double()
    ref = _reference(three_layers, IDS, layers)
    assert (ours - ref).abs().max().item() < 1e-4
    full = _reference(three_layers, IDS, 3)
    assert (ours - full).abs().max().item() > 0.1  # not the whole model's


def _logits(draft: ModelRunner) -> torch.Tensor:
    """Every position's logits of IDS through `draft`: a prompt, then one decode step."""
    pool = BlockPool(draft.num_blocks, draft.page_size, enable_prefix_cache=False)
    seq = DraftSeq(IDS[:-1], [], block_table=pool.allocate(3))
    prompt = draft.forward([seq], [len(IDS) - 1], [len(IDS) - 1])
    seq.num_computed = len(IDS) - 1
    seq.output_ids.append(IDS[-1])
    return torch.cat([prompt, draft.forward([seq], [1], [1])]).double()


def test_a_draft_of_every_layer_is_refused_unless_quantized(three_layers):
    """All the layers as they are would be the target itself; an int8 copy of them is the
    target's logits to int8's rounding, from weights of its own."""
    target = ModelRunner(three_layers, max_total_tokens=512, device="cpu", dtype="float32")
    args = ServerArgs(device="cpu", dtype="float32", speculative_algorithm="SELF",
                      speculative_draft_layers=3)
    with pytest.raises(ValueError, match="--speculative-draft-layers must be >= 1 and < the "
                       "model's 3 layers, not 3"):
        self_draft_proposer(args, target, three_layers, None, 512)
    args = replace(args, speculative_draft_model_quantization="int8")
    draft = self_draft_proposer(args, target, three_layers, None, 512).runner
    assert draft.model is not target.model and draft.linear_backend == "native_int8"
    assert draft.num_layers == len(draft.kv_caches) == 3 and draft.num_blocks == 32
    ours = _logits(draft)
    served = ModelRunner(three_layers, max_total_tokens=512, device="cpu", dtype="float32",
                         quantization="int8")  # the model served with --quantization int8
    assert (ours - _logits(served)).abs().max().item() < 1e-4
    ref = _reference(three_layers, IDS, 3)  # the float model's, which the target computes
    err = (ours - ref).abs().max().item()
    assert 0 < err < 0.05 * ref.abs().max().item(), err
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
