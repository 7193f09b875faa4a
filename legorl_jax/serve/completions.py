"""`POST /v1/completions`: one engine request per (prompt, n), their events
gathered on the event loop, answered whole or streamed as SSE."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import cast

from legorl_jax.core.surrogates import replace_lone_surrogates
from legorl_jax.serve.loader import ServedModel
from legorl_jax.serve.output import ChoiceBuilder, ChoiceOptions
from legorl_jax.serve.protocol import CompletionRequest, CompletionResponse, UsageInfo, error_body
from legorl_jax.serve.request_types import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenRequest,
    PromptLogprobsEvent,
    SamplingParams,
    TokenEvent,
)


class EngineFailure(RuntimeError):
    """The engine failed a request that was already accepted."""


def tokenize_prompts(served: ServedModel, req: CompletionRequest) -> list[list[int]]:
    prompt = req.prompt
    single = isinstance(prompt, str) or isinstance(prompt[0], int)
    # Validation picked one member of the union, so a list's first item tells what all its items are.
    prompts = cast("list[str | list[int]]", [prompt] if single else prompt)
    return [
        p
        if isinstance(p, list)
        # A JS client cutting text by UTF-16 units sends half a pair, which no tokenizer encodes.
        else served.tokenizer.encode(replace_lone_surrogates(p), add_special_tokens=req.add_special_tokens)
        for p in prompts
    ]


class CompletionRun:
    """The engine requests behind one completions call and their choice builders."""

    def __init__(self, served: ServedModel, req: CompletionRequest, as_token_ids_default: bool) -> None:
        self.served = served
        self.req = req
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.prompts = tokenize_prompts(served, req)
        as_ids = req.return_tokens_as_token_ids
        options = ChoiceOptions(
            stop_strings=tuple(req.stop_strings()),
            include_stop_str=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logprobs=req.logprobs,
            tokens_as_ids=as_token_ids_default if as_ids is None else as_ids,
            return_token_ids=req.return_token_ids,
            return_weight_versions=req.return_weight_versions,
        )
        self.builders = [
            ChoiceBuilder(i * req.n + j, prompt, served.tokenizer, options)
            for i, prompt in enumerate(self.prompts)
            for j in range(req.n)
        ]
        # Validates every prompt before any is submitted, so a 400 leaves nothing running.
        self.max_tokens = [served.engine.validate(p, req.max_tokens) for p in self.prompts]

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.served.engine
        for builder in self.builders:
            prompt_index = builder.index // self.req.n
            seed = self.req.seed + builder.index if self.req.seed is not None else uuid.uuid4().int
            params = SamplingParams(
                max_tokens=self.max_tokens[prompt_index],
                temperature=self.req.temperature,
                top_p=self.req.top_p,
                top_k=self.req.top_k,
                seed=seed,
                stop_token_ids=frozenset(self.req.stop_token_ids or ()),
                logprobs=self.req.logprobs,
                prompt_logprobs=self.req.prompt_logprobs,
                ignore_eos=self.req.ignore_eos,
            )
            index = builder.index

            def sink(event: Event, index: int = index) -> None:
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

            engine.submit(GenRequest(self._rid(index), builder.prompt, params, sink))

    def _rid(self, index: int) -> str:
        return f"{self.id}-{index}"

    def abort_unfinished(self) -> None:
        for builder in self.builders:
            if not builder.finished:
                self.served.engine.abort(self._rid(builder.index))

    @property
    def done(self) -> bool:
        return all(b.finished for b in self.builders)

    async def next_event(self) -> int:
        """Applies one engine event; returns the index of the choice it touched."""
        index, event = await self.queue.get()
        builder = self.builders[index]
        if isinstance(event, TokenEvent):
            if builder.add_token(event):
                self.served.engine.abort(self._rid(index))
        elif isinstance(event, PromptLogprobsEvent):
            builder.set_prompt_logprobs(event.entries)
        elif isinstance(event, FinishEvent):
            builder.finish(event)
        elif isinstance(event, ErrorEvent):
            raise EngineFailure(event.message)
        return index

    def usage(self) -> UsageInfo:
        prompt = sum(len(p) for p in self.prompts) * self.req.n
        completion = sum(len(b.token_ids) for b in self.builders)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def collect(self) -> CompletionResponse:
        try:
            while not self.done:
                await self.next_event()
        finally:
            self.abort_unfinished()
        return CompletionResponse(
            id=self.id,
            model=self.served.name,
            choices=[b.final() for b in self.builders],
            usage=self.usage(),
        )

    async def stream(self) -> AsyncIterator[str]:
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        try:
            while not self.done:
                index = await self.next_event()
                choice = self.builders[index].delta()
                if choice is not None:
                    chunk = CompletionResponse(id=self.id, model=self.served.name, choices=[choice])
                    yield _sse(chunk.model_dump())
            if include_usage:
                last = CompletionResponse(id=self.id, model=self.served.name, choices=[], usage=self.usage())
                yield _sse(last.model_dump())
        except EngineFailure as exc:
            yield _sse(error_body(str(exc), "InternalServerError", 500))
        finally:
            # Also runs when the client disconnects and the generator is closed.
            self.abort_unfinished()
        yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
