"""Tokenizer service: encode (plain or chat template) and stateless incremental detokenization.
Stateless, so any number of instances share the `tokenizer` queue group."""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import msgspec

from radixflow.shared import subjects
from radixflow.shared.actor import Actor
from radixflow.shared.bus import Bus
from radixflow.shared.config import ServiceConfig
from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import (ChatOptions, DetokenizeReply, DetokenizeRequest, DetokItem, DetokResult,
                                       EncodeReply, EncodeRequest, StatusRequest, TokenizerInfo)

from .tokenizer import Tokenizer

# Long prompts take milliseconds to encode: off the event loop, but a small pool, since the Rust
# tokenizer already uses its own threads.
_POOL_SIZE = 2


class TokenizerService(Actor):
    service = "tokenizer"

    def __init__(self, bus: Bus, model_path: str, service_config: ServiceConfig | None = None, instance: str | None = None):
        super().__init__(bus, service_config, instance)
        self.model_path = model_path
        self.tok: Tokenizer | None = None
        self._pool = ThreadPoolExecutor(_POOL_SIZE, thread_name_prefix="tokenizer")
        self.route(subjects.TOKENIZER_ENCODE, EncodeRequest, self.encode, queue="tokenizer")
        self.route(subjects.TOKENIZER_DETOKENIZE, DetokenizeRequest, self.detokenize, queue="tokenizer")
        self.route(subjects.TOKENIZER_INFO, StatusRequest, self.info, queue="tokenizer")

    async def on_start(self) -> None:
        self.tok = await asyncio.get_running_loop().run_in_executor(self._pool, Tokenizer, self.model_path)

    async def on_stop(self) -> None:
        self._pool.shutdown(wait=False)

    def status(self) -> dict:
        return {"vocab_size": self.tok.vocab_size if self.tok else 0}

    async def encode(self, req: EncodeRequest) -> EncodeReply:
        if sum(x is not None for x in (req.text, req.messages, req.texts)) != 1:
            raise BadRequest("give exactly one of text, messages or texts")
        loop = asyncio.get_running_loop()
        if req.texts is not None:
            batch = await loop.run_in_executor(self._pool, lambda: [self.tok.encode(t) for t in req.texts])
            return EncodeReply(batch=batch)
        if req.text is not None:
            ids = await loop.run_in_executor(self._pool, self.tok.encode, req.text)
        else:
            msgs = [msgspec.to_builtins(m) for m in req.messages]
            for m in msgs:
                m.pop("type", None)
            opts = req.chat or ChatOptions()
            kwargs = dict(opts.template_kwargs)
            if opts.tools is not None:
                kwargs["tools"] = opts.tools
            if opts.continue_final_message:
                kwargs["continue_final_message"] = True
            try:
                ids = await loop.run_in_executor(
                    self._pool, lambda: self.tok.encode_chat(msgs, opts.add_generation_prompt, **kwargs))
            except Exception as e:   # a template error is the caller's input, not our crash
                raise BadRequest(f"chat template failed: {e}", param="messages") from None
        return EncodeReply(input_ids=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        n = self.tok.vocab_size
        for i, it in enumerate(req.items):
            if it.ids and not (0 <= min(it.ids) and max(it.ids) < n):
                raise BadRequest(f"items[{i}].ids: token ids must lie in [0, {n})", param="ids")
            if not 0 <= it.prefix_offset <= it.read_offset <= len(it.ids) + it.prefix_offset:
                raise BadRequest(f"items[{i}]: offsets must satisfy 0 <= prefix_offset <= read_offset", param="read_offset")
        return DetokenizeReply(items=detokenize_items(self.tok, req.items))

    async def info(self, _: StatusRequest) -> TokenizerInfo:
        return TokenizerInfo(vocab_size=self.tok.vocab_size, eos_token_ids=sorted(self.tok.eos_token_ids),
                             identity=self.tok.identity, path=os.path.abspath(self.model_path))


def detokenize_items(tok: Tokenizer, items: list[DetokItem]) -> list[DetokResult]:
    """A DetokenizeRequest's items (also what a scheduler with a local tokenizer runs)."""
    out = []
    for it in items:
        # the window starts at prefix_offset: shift offsets into it and back (see Tokenizer docs)
        text, p, r = tok.detokenize_incremental(it.ids, 0, it.read_offset - it.prefix_offset,
                                                it.skip_special_tokens, flush=it.flush)
        out.append(DetokResult(text=text, prefix_offset=p + it.prefix_offset, read_offset=r + it.prefix_offset))
    return out
