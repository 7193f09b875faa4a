"""One model call, dialect-neutral: caps, prompt ids (with sampled turns
reused), the engine call under the trainer's sampling, completion parsing,
and the record in the session's trajectory."""

from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast, get_args

from legorl_jax.core.config import ProxyConfig
from legorl_jax.core.seeds import derive_seed
from rollout_server.backends.client import TokenRoute
from rollout_server.proxy.completion_parser import ToolCallFormat, parse_completion
from rollout_server.proxy.conversation import AssistantOutput, ChatRequest, ToolSpec
from rollout_server.proxy.engine_client import CompletionParams, EngineCompletion, ProxyEngineClient
from rollout_server.proxy.errors import ProxyError
from rollout_server.proxy.render import TEMPLATE_OVERRIDE, ChatTemplate, Prompt, SampledTurn
from rollout_server.proxy.session import Session, SessionStore
from rollout_server.proxy.trajectory import CallRecord
from rollout_server.proxy.turn import TurnResult

if TYPE_CHECKING:  # the providers' SDKs load only where a chat teacher is the engine
    from rollout_server.proxy.chat_teacher import ChatTeacher

log = logging.getLogger(__name__)


@dataclass
class PreparedCall:
    session: Session
    request: ChatRequest
    dialect: str
    id_prefix: str
    prompt: Prompt
    sampling: CompletionParams
    started: float
    matched: dict[int, SampledTurn]  # what `prompt` was rendered with
    enable_thinking: bool
    hung_up: bool = False  # the harness left before the answer's last event
    record: CallRecord | None = None  # once the engine answered


class ProxyCore:
    def __init__(
        self,
        template: ChatTemplate,
        engine: ProxyEngineClient | ChatTeacher,
        store: SessionStore,
        *,
        max_context: int,
        tool_call_format: ToolCallFormat = "hermes",
        model_name: str | None = None,
    ) -> None:
        self.template = template
        self.engine = engine
        self._model_name = model_name
        self.store = store
        self.max_context = max_context
        self.tool_call_format: ToolCallFormat = tool_call_format

    @property
    def model_name(self) -> str:
        """What harnesses call the model (and /v1/models lists): the given name, else the engine's. Calls
        reach the engine under its own name either way; asked only when a harness needs the name."""
        return self._model_name or self.engine.model

    def _thinking(self, session: Session, request: ChatRequest) -> bool:
        if session.spec.enable_thinking is not None:
            return session.spec.enable_thinking
        return True if request.enable_thinking is None else request.enable_thinking

    def count_tokens(self, session: Session, request: ChatRequest) -> int:
        matched = session.match_turns(request.messages)
        return len(self.template.render(request, matched, self._thinking(session, request), session.prefix).ids)

    def prepare(self, session: Session, request: ChatRequest, dialect: str, id_prefix: str) -> PreparedCall:
        """Everything that can refuse a call, before any byte goes back to the
        harness, so refusals are plain HTTP errors in the dialect's shape."""
        started = time.perf_counter()
        session.check_caps()
        matched = session.match_turns(request.messages)
        thinking = self._thinking(session, request)
        prompt = self.template.render(request, matched, thinking, session.prefix)
        room = self.max_context - len(prompt.ids)
        if room < 1:
            raise ProxyError(
                "prompt_too_long",
                f"prompt is too long: {len(prompt.ids)} tokens > {self.max_context - 1} maximum",
                prompt_tokens=len(prompt.ids),
                max_context=self.max_context,
            )
        cfg = session.spec.sampling
        asked = request.max_tokens if request.max_tokens and request.max_tokens > 0 else cfg.max_tokens
        sampling = CompletionParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_tokens=min(asked, cfg.max_tokens, room),
            stop_token_ids=(self.template.turn_end_id,),
            seed=None if session.spec.seed is None else derive_seed(session.spec.seed, session.calls_started),
        )
        session.calls_started += 1
        return PreparedCall(session, request, dialect, id_prefix, prompt, sampling, started, matched, thinking)

    async def execute(self, call: PreparedCall) -> TurnResult:
        """The engine call and its record. Runs to the end even when the
        harness hangs up mid-stream, so the sampled turn is still captured.
        Its session is busy meanwhile: never expired while its engine call runs."""
        call.session.busy += 1
        try:
            return await self._execute(call)
        finally:
            call.session.busy -= 1
            call.session.last_active = time.monotonic()

    async def _execute(self, call: PreparedCall) -> TurnResult:
        session = call.session
        sampling = call.sampling
        engine_start = time.perf_counter()
        teacher_output = None
        # A chat teacher answers in messages; anything else with ProxyEngineClient's `complete` (the demo
        # oracles too) samples token ids.
        if hasattr(self.engine, "answer"):
            completion, teacher_output = await self._teacher_turn(cast("ChatTeacher", self.engine), call)
        else:
            if self._recompute(session, call.prompt):
                sampling = replace(sampling, prompt_logprobs=True)
            completion = await self.engine.complete(call.prompt.ids, sampling)
        engine_latency = time.perf_counter() - engine_start
        ids = list(completion.token_ids)
        end_id = self.template.turn_end_id
        body = ids[:-1] if ids and ids[-1] == end_id else ids
        closing = [] if ids and ids[-1] == end_id else [end_id]
        output = (
            teacher_output
            if teacher_output is not None
            else parse_completion(
                self.template.decode(body),
                self.tool_call_format,
                call.request.tools,
                lambda: call.id_prefix + secrets.token_hex(12),
            )
        )
        retrained = _reused_sampled(call.prompt, completion.prompt_logprobs)
        # No await from here on: the record is atomic with respect to the
        # session's other calls on this event loop.
        version = session.spec.policy_version
        seq, merged = session.trajectory.place(
            call.prompt.ids,
            call.request.root_key(),
            has_tools=bool(call.request.tools),
            has_history=any(m.role == "assistant" for m in call.request.messages),
            policy_version=version,
        )
        seq.extend_sampled(ids, completion.logprobs, completion.versions, version)
        seq.extend(closing, [0] * len(closing), [0.0] * len(closing))
        if not merged:  # a sequence this call opened: the reused sampled tokens are trained in it too
            # Prompt logprobs come from the prefill, under the weights of the first sampled token.
            seq.train_on(*retrained, version=completion.versions[0] if completion.versions else version)
        tail = call.prompt.gen_tail
        turn = SampledTurn(
            len(session.turns),
            tuple(tail + ids + closing),
            tuple([0] * len(tail) + [1] * len(ids) + [0] * len(closing)),
            tuple([0.0] * len(tail) + list(completion.logprobs) + [0.0] * len(closing)),
            output,
        )
        session.add_turn(turn)
        self.template.remember_sampled(
            session.prefix, call.request, call.matched, call.enable_thinking, call.prompt, turn
        )
        index = len(session.trajectory.calls)
        seq.calls.append(index)
        call.record = CallRecord(
            index=index,
            dialect=call.dialect,
            stream=call.request.stream,
            sequence=seq.index,
            merged=merged,
            prompt_tokens=len(call.prompt.ids),
            completion_tokens=len(ids),
            finish_reason=completion.finish_reason,
            tool_calls=len(output.tool_calls),
            parse_error=output.parse_error,
            reused_turns=call.prompt.reused_turns,
            unmatched_turns=call.prompt.unmatched_turns,
            sampling=sampling.record(),
            policy_version=version,
            engine_latency_s=engine_latency,
            incremental_render=call.prompt.incremental,
            recomputed_tokens=0 if merged else len(retrained[0]),
            latency_s=time.perf_counter() - call.started,
            client_disconnected=call.hung_up,
            rerendered=teacher_output is not None,
        )
        session.trajectory.calls.append(call.record)
        return TurnResult(output, completion.finish_reason, len(call.prompt.ids), len(ids), index)

    async def _teacher_turn(self, teacher: ChatTeacher, call: PreparedCall) -> tuple[EngineCompletion, AssistantOutput]:
        """A chat teacher's answer, and the ids this model would have sampled to
        write it: recorded as sampled, with logprobs 0 (none are this model's;
        the call record says re-rendered)."""
        answer = await teacher.answer(call.request, call.sampling)
        ids = self.template.written_turn(
            call.request, call.matched, call.enable_thinking, call.prompt.gen_tail, answer.output
        )
        if answer.finish_reason == "length":  # cut short: the turn end is closed by the proxy, as for an engine
            ids = ids[:-1]
        return EngineCompletion(tuple(ids), (0.0,) * len(ids), answer.finish_reason), answer.output

    @staticmethod
    def _recompute(session: Session, prompt: Prompt) -> bool:
        """Prompt logprobs are worth asking for when the session wants them and
        the call opens a new sequence (history rewritten) that still reuses
        sampled turns: those tokens can then be trained in it."""
        return (
            session.spec.recompute_logprobs
            and bool(prompt.reused_spans)
            and session.trajectory.extendable(prompt.ids) is None
        )

    def finish(self, call: PreparedCall) -> None:
        """Stamps the end-to-end latency once the answer is rendered."""
        assert call.record is not None, "called once `execute` made the record"
        call.record.latency_s = time.perf_counter() - call.started

    def hang_up(self, call: PreparedCall) -> None:
        """The harness hung up before the answer's last event: its record says
        so, with the latency up to now (or, while the engine still works, up to
        when it answers: the call goes on to be captured)."""
        call.hung_up = True
        if call.record is not None:
            call.record.client_disconnected = True
            self.finish(call)


def _reused_sampled(prompt: Prompt, logprobs: tuple[float | None, ...] | None) -> tuple[list[int], list[float]]:
    """The prompt positions of the reused turns' sampled tokens, with the
    engine's recomputed logprobs for them (none when none were asked for)."""
    if logprobs is None:
        return [], []
    positions = [start + j for start, turn in prompt.reused_spans for j, trained in enumerate(turn.mask) if trained]
    values = [logprobs[at] for at in positions]
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if len(finite) != len(values):
        raise ProxyError("engine_unavailable", "inference engine sent no finite prompt logprob for a reused token")
    return positions, finite


def load_template(model_dir: str | Path, config: ProxyConfig) -> ChatTemplate:
    """The tokenizer in `model_dir` with its chat template, or with the
    template file `config.chat_template` instead. A template that renders no
    tools is said at once: every request with tools will be refused."""
    from transformers import AutoTokenizer

    # A local directory only: the proxy never fetches from a model hub.
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if config.chat_template is not None:
        try:
            tokenizer.chat_template = Path(config.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat template file {config.chat_template}: {exc}") from None
        if not tokenizer.chat_template.strip():
            raise ValueError(f"chat template file {config.chat_template} is empty")
    template = ChatTemplate(tokenizer)
    source = config.chat_template or f"the tokenizer of {model_dir}"
    if not template.renders_tools:
        log.warning(
            "the chat template of %s renders no tools: requests that offer tools will be refused (400); "
            "give the proxy one that renders tools: %s",
            source,
            TEMPLATE_OVERRIDE,
        )
    elif (text := template.call_text()) is not None and not _reads_call(text, config.tool_call_format):
        # The model learnt its calls from this template: a parser that cannot read them takes them for prose.
        readers = [fmt for fmt in get_args(ToolCallFormat) if _reads_call(text, fmt)]
        log.warning(
            "the chat template of %s writes tool calls as %r, which proxy.tool_call_format %r does not "
            "read: the model's calls would reach the harness as text%s",
            source,
            text,
            config.tool_call_format,
            f"; {' or '.join(readers)} does" if readers else "",
        )
    return template


def _reads_call(text: str, fmt: ToolCallFormat) -> bool:
    """Whether `fmt` reads `text` (see `ChatTemplate.call_text`) as the call it is."""
    output = parse_completion(text, fmt, [ToolSpec("f", "d", {"type": "object"})], lambda: "c")
    return [(c.name, c.arguments) for c in output.tool_calls] == [("f", {"a": "v"})]


def build_core(
    model_dir: str | Path,
    engine: str | ChatTeacher,
    *,
    served_model: str,
    max_context: int,
    config: ProxyConfig | None = None,
    template: ChatTemplate | None = None,
    unit_temperature_prompt_logprobs: bool = True,
    token_route: TokenRoute = "completions",
) -> ProxyCore:
    """A proxy core for the model in `model_dir` (its tokenizer and chat
    template, unless `template` is given, loaded already) in front of the
    engine at the URL `engine` (or a chat teacher, whose answers are recorded as
    this model writes them), with the config's caps as every session's default.
    An engine is taken for vLLM (prompt logprobs at temperature 1) unless
    `unit_temperature_prompt_logprobs` says otherwise; `token_route` is where its
    token-id calls go (`rollout_server.backends.client.TokenRoute`)."""
    cfg = config or ProxyConfig()
    store = SessionStore(cfg.session_caps(), max_sessions=cfg.max_sessions, idle_timeout_s=cfg.session_idle_timeout_s)
    client = (
        ProxyEngineClient(
            engine,
            served_model,
            unit_temperature_prompt_logprobs=unit_temperature_prompt_logprobs,
            token_route=token_route,
        )
        if isinstance(engine, str)
        else engine
    )
    return ProxyCore(
        template or load_template(model_dir, cfg),
        client,
        store,
        max_context=max_context,
        tool_call_format=cfg.tool_call_format,
        model_name=cfg.model_name,
    )
