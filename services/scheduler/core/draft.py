"""A draft model for speculative decoding: SGLang's STANDALONE (vLLM's draft_model), and our
SELF, the target's own first L layers.

A second, smaller model with the target's vocabulary (STANDALONE), or the target itself run
through its first `--speculative-draft-layers` layers, then its final norm and lm_head (SELF:
the same module objects, no weights of its own; `ModelRunner.first_layers`; or, with
`--speculative-draft-model-quantization`, an int8/int4 copy of them), proposes each
decoding request's next k tokens greedily (deterministic drafts: verification stays exact,
`speculative.py`). It keeps its own paged KV: a pool of its own blocks, one `DraftSeq` per
request (on the request, as its proposer state), released when the request ends. SELF's KV of
the first L layers for accepted tokens equals the target's; a cache of its own is simpler
than sharing the target's blocks (whose rejected slots the draft would overwrite), and costs
L / num_layers of the target's KV bytes.

Each step, for the requests that draft:

    draft KV valid up to  min(seq.num_computed, req.num_computed)   (accepted tokens kept)
    SELF: copy            the target's KV of [valid, req.num_computed) for the draft's
                          layers: the prompt, or the accepted drafts the draft did not run
    forward 1: catch up   tokens [valid, len(tokens)): the last verified token (SELF: only
                          the step's new token), or the prompt on a request's first draft
                          (in chunks; STANDALONE), logits of the last
    forwards 2..k:        one token each, the draft just proposed, at the next position

Rejected drafts' KV lies past the valid end and is overwritten, as in the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import ServerArgs
from common.logging import get_logger
from common.modelstore import gguf_source, prepare_model
from services.scheduler.attention.base import cache_slots
from services.scheduler.core.kv_pool import BlockPool
from services.scheduler.core.request import Request
from services.scheduler.core.sampler import argmax
from services.scheduler.executor.model_runner import ModelRunner

log = get_logger("draft")

CATCH_UP_CHUNK = 512  # most prompt tokens a request's draft catches up on in one step


@dataclass(eq=False)
class DraftSeq:
    """One request as the draft model sees it (the runner's Sequence protocol)."""

    prompt_ids: list[int]
    output_ids: list[int]
    draft_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    lora_name: str | None = None  # STANDALONE runs without adapters; SELF under the request's


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, target_vocab_size: int,
                 kv_source: ModelRunner | None = None) -> None:
        if runner.vocab_size != target_vocab_size:
            raise ValueError(
                f"--speculative-draft-model-path: the draft model's vocabulary has "
                f"{runner.vocab_size} tokens, the target's {target_vocab_size}: a draft must "
                "share the target's tokenizer")
        self.runner = runner
        self.pool = BlockPool(runner.num_blocks, runner.page_size, enable_prefix_cache=False)
        self.page_size = runner.page_size
        # SELF: the target's KV of its first layers is what the draft would compute (the same
        # layers: exactly; a quantized copy of them: nearly), so a request's verified tokens
        # are copied from the target's cache, not run through the draft (_copy_verified)
        self.kv_source = kv_source
        if kv_source is not None:  # built from the target's own args: the same KV layout
            (dk, _), (tk, _) = runner.kv_caches[0], kv_source.kv_caches[0]
            assert (dk.shape[1:], dk.dtype) == (tk.shape[1:], tk.dtype), (dk.shape, tk.shape)

    def new_state(self) -> None:
        return None  # made on the request's first draft, with its lists

    def propose(self, tokens, k: int, state=None) -> list[int]:
        raise NotImplementedError("the draft model proposes for a batch: propose_batch")

    @torch.inference_mode()
    def propose_batch(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy drafts for each request (none for one still catching up)."""
        seqs, ns, copies = [], [], []
        for req, k in zip(reqs, ks, strict=True):
            seq = self._seq(req)
            seq.num_computed = min(seq.num_computed, req.num_computed)
            seq.draft_ids = []
            # SELF: the target's verified tokens come from its cache, the rest is run
            start = req.num_computed if self.kv_source is not None else seq.num_computed
            n = min(req.num_tokens - start, CATCH_UP_CHUNK)
            if not self._reserve(seq, start + n + k - 1):
                n = 0
            elif start > seq.num_computed:
                copies.append((req, seq))
            seqs.append(seq)
            ns.append(n)
        if copies:
            self._copy_verified(copies)
        live = [i for i, n in enumerate(ns) if n]
        drafts: list[list[int]] = [[] for _ in reqs]
        if not live:
            return drafts
        # forward 1: catch up; a request whose catch-up is not over yet drafts next step
        ready = [i for i in live if seqs[i].num_computed + ns[i] == reqs[i].num_tokens]
        logits = self.runner.forward([seqs[i] for i in live], [ns[i] for i in live],
                                     [int(i in ready) for i in live])
        for i in live:
            seqs[i].num_computed += ns[i]
        if not ready:
            return drafts
        for i, token in zip(ready, argmax(logits).tolist(), strict=True):
            drafts[i].append(token)
        for _ in range(1, max((ks[i] for i in ready), default=0)):
            going = [i for i in ready if len(drafts[i]) < ks[i]]
            if not going:
                break
            for i in going:
                seqs[i].draft_ids = drafts[i][:-1]  # the runner reads the newest as input
            logits = self.runner.forward([_Step(seqs[i], drafts[i][-1]) for i in going],
                                         [1] * len(going), [1] * len(going))
            for i, token in zip(going, argmax(logits).tolist(), strict=True):
                seqs[i].num_computed += 1
                drafts[i].append(token)
        return drafts

    def _seq(self, req: Request) -> DraftSeq:
        if req.proposer_state is None:
            # a runner with LoRA is the target's own layers: the request's adapter applies
            lora = req.lora_name if self.runner.lora is not None else None
            req.proposer_state = DraftSeq(req.prompt_ids, req.output_ids, lora_name=lora)
        return req.proposer_state

    def _copy_verified(self, pairs: list[tuple[Request, DraftSeq]]) -> None:
        """For each (request, its draft), the target's K and V of positions
        [seq.num_computed, req.num_computed) (tokens it has verified: a prompt, or a step's
        accepted drafts) into the draft's cache, for the draft's layers, in one gather and
        scatter a layer for all of them: where a catch-up forward of the draft would cost a
        prefill."""
        src, dst = [], []
        for req, seq in pairs:
            begin, end = seq.num_computed, req.num_computed
            src += cache_slots(req.block_table, begin, end, self.page_size)
            dst += cache_slots(seq.block_table, begin, end, self.page_size)
            seq.num_computed = end
        dev = self.runner.kv_caches[0][0].device
        src_t, dst_t = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        target = self.kv_source.kv_caches[: len(self.runner.kv_caches)]  # its first L layers
        for (dk, dv), (tk, tv) in zip(self.runner.kv_caches, target, strict=True):
            dk[dst_t] = tk[src_t]
            dv[dst_t] = tv[src_t]

    def _reserve(self, seq: DraftSeq, tokens: int) -> bool:
        """Blocks for the draft's KV up to `tokens` positions; False if the pool is short."""
        need = -(-tokens // self.page_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_evictable:
            return False
        seq.block_table += self.pool.allocate(need)
        return True

    def release(self, req: Request) -> None:
        seq = req.proposer_state
        if isinstance(seq, DraftSeq) and seq.block_table:
            self.pool.release(seq.block_table)
            seq.block_table = []
            seq.num_computed = 0


@dataclass(eq=False)
class _Step:
    """A draft step's view: the request's tokens and drafts so far, the newest as input."""

    seq: DraftSeq
    newest: int

    @property
    def prompt_ids(self) -> list[int]:
        return self.seq.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.seq.output_ids

    @property
    def draft_ids(self) -> list[int]:
        return [*self.seq.draft_ids, self.newest]

    @property
    def num_computed(self) -> int:
        return self.seq.num_computed

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    @property
    def lora_name(self) -> str | None:
        return self.seq.lora_name


def draft_proposer(args: ServerArgs, target: ModelRunner, target_tokenizer: Path,
                   max_model_len: int) -> DraftModelProposer:
    """Load --speculative-draft-model-path beside the target: same device, dtype and page
    size, a KV pool of the target's token count (its bytes on top: the start-up log says)."""
    path = prepare_model(args.speculative_draft_model_path, args.cache_dir)
    check_same_vocabulary(path / "tokenizer.json", target_tokenizer,
                          args.speculative_draft_model_path)
    runner = ModelRunner(
        path, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
        page_size=args.page_size, max_total_tokens=target.num_blocks * target.page_size,
        max_model_len=max_model_len,
        quantization=args.speculative_draft_model_quantization or "none",
        gguf_path=gguf_source(args.speculative_draft_model_path), draft=True)
    log.info(f"draft model {path.name}: {runner.num_parameters / 1e6:.0f}M parameters, "
             f"weights {runner.linear_backend}, its own KV cache of "
             f"{runner.kv_bytes / (1 << 30):.2f} GiB")
    return DraftModelProposer(runner, target.vocab_size)


def self_draft_proposer(args: ServerArgs, target: ModelRunner, path: Path,
                        gguf_path: Path | None, max_model_len: int) -> DraftModelProposer:
    """SELF: the target's first --speculative-draft-layers layers as its draft, with a KV pool
    of the target's token count for those layers (its bytes on top: the start-up log says).

    With --speculative-draft-model-quantization int8 or int4 the draft is a quantized copy of
    the target (its weights read again from `path`, the layers past the draft's dropped): its
    proposals are the quantized model's greedy tokens, which mostly are the target's, and it
    runs at the quantized model's speed; verification keeps the target's exact output."""
    tokens = target.num_blocks * target.page_size
    mode = args.speculative_draft_model_quantization or "none"
    layers = args.speculative_draft_layers
    if mode == "none":
        if not 1 <= layers < target.num_layers:
            raise ValueError(f"--speculative-draft-layers must be >= 1 and < the model's "
                             f"{target.num_layers} layers, not {layers}")
        runner = target.first_layers(layers, tokens)
        weights = "the target's own"
    else:
        layers = target.num_layers if layers is None else layers
        if not 1 <= layers <= target.num_layers:
            raise ValueError(f"--speculative-draft-layers must be >= 1 and <= the model's "
                             f"{target.num_layers} layers, not {layers}")
        copy = ModelRunner(
            path, device=args.device, dtype=args.dtype,
            attention_backend=args.attention_backend, page_size=args.page_size,
            max_total_tokens=args.page_size, max_model_len=max_model_len, quantization=mode,
            gguf_path=gguf_path, draft=True)
        del copy.model.layers[layers:]  # never run: their weights go
        runner = copy.first_layers(layers, tokens)
        weights = f"a {mode} copy ({runner.linear_backend}) of the target's"
    log.info(f"self-speculative draft: {weights} first {runner.num_layers} of "
             f"{target.num_layers} layers and head, its own KV cache of "
             f"{runner.kv_bytes / (1 << 30):.2f} GiB")
    return DraftModelProposer(runner, target.vocab_size, kv_source=target)


def check_same_vocabulary(draft: Path, target: Path, flag_value: str) -> None:
    """A draft proposes token ids: they must mean the target's tokens (a ValueError naming
    both vocabularies otherwise)."""
    from tokenizers import Tokenizer

    ours, theirs = Tokenizer.from_file(str(target)), Tokenizer.from_file(str(draft))
    if ours.get_vocab(with_added_tokens=True) != theirs.get_vocab(with_added_tokens=True):
        raise ValueError(
            f"--speculative-draft-model-path {flag_value}: its vocabulary "
            f"({theirs.get_vocab_size(with_added_tokens=True)} tokens) is not the target's "
            f"({ours.get_vocab_size(with_added_tokens=True)} tokens, {target.parent.name}): a "
            "draft must share the target's tokenizer")
