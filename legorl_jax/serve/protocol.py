"""Request and response bodies of the engine's HTTP surface, in vLLM's shapes.

Only the subset of vLLM's OpenAI-compatible protocol that the project calls is
modelled. Unknown request fields are ignored (as vLLM does) so OpenAI SDK
clients that send extra keys keep working; known fields are validated and a bad
value becomes a vLLM-shaped 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# vLLM's default --max-logprobs; top-k alternatives are computed on device for this many.
MAX_LOGPROBS = 20
# Every number of a request is bounded here, at the edge: an engine step packs
# them into 32-bit arrays, and a value past these bounds is a mistake.
I32_MAX = 2**31 - 1
MAX_TEMPERATURE = 1e3
MAX_PROMPTS = 256  # prompts in one batched request
MAX_STOPS = 64  # stop strings, and stop token ids
MAX_STOP_CHARS = 1024  # length of one stop string

TokenId = Annotated[int, Field(ge=0, le=I32_MAX)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class CompletionRequest(_Lenient):
    """`POST /v1/completions`. A prompt is text, a list of token ids, or a batch of either."""

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=I32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, le=I32_MAX)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM's bounds: a 64-bit integer
    n: int = Field(1, ge=1, le=64)
    min_tokens: int = Field(0, ge=0, le=I32_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOPS)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_weight_versions: bool = False
    return_tokens_as_token_ids: bool | None = None
    skip_special_tokens: bool = True
    add_special_tokens: bool = True

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (disable) or at least 1")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        # Text that tokenizes to nothing is refused by the engine, like any empty prompt.
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(isinstance(p, list | str) and not p for p in value):
            raise ValueError("a prompt in a batch must not be empty")
        if isinstance(value, list) and isinstance(value[0], list | str) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by this engine")
        if self.min_tokens:
            # Ignoring it would end completions earlier than the client asked.
            raise ValueError("min_tokens is not supported by this engine")
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ChatMessage(_Lenient):
    role: str
    content: Any = None
    model_config = ConfigDict(extra="allow")


class TokenizeRequest(_Lenient):
    """`POST /tokenize`: either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        if self.add_generation_prompt and self.continue_final_message and self.messages is not None:
            raise ValueError("add_generation_prompt and continue_final_message are mutually exclusive")
        return self


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


class CollectiveRpcRequest(_Lenient):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = Field(None, ge=0.0, allow_inf_nan=False)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs block, as vLLM fills it."""

    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class WeightVersionSpan(BaseModel):
    """vLLM 0.33's per-token weight versions: output tokens [start, end) were
    sampled by the weights labelled `version`."""

    version: str
    start: int
    end: int


class UpdateWeightVersionRequest(_Lenient):
    """`POST /update_weight_version`: the label later sampled tokens carry."""

    new_version: str = Field(min_length=1, max_length=256)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400, param: str | None = None) -> dict:
    """vLLM's error shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
