"""Continuous-batching generation over a fixed set of KV-cache slots.

One background thread owns the device. Each iteration it admits waiting
requests into free slots, runs one `DeviceStep` over all slots (prefill chunks
and single decode tokens together), and hands every request its new token
through the request's `sink`. Finished requests leave their slot at once, so
new ones join a running batch between steps.

A slot's state is just its token list, the pool blocks reserved for it, and
how many of those tokens have K/V in the cache (`cached`): prefill and decode
are both "feed tokens[cached:]". A request is admitted only when the pool has
blocks for its prompt and completion (else it waits), and starts with `cached`
past whatever prefix the prefix cache already holds (`blocks.py`). Invalidating
the cache after a weight reload is: forget every cached prefix and set
cached = 0, so each slot recomputes its K/V under the new weights.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from legorl_jax.core.engine_api import PauseMode
from legorl_jax.serve.blocks import BlockPool
from legorl_jax.serve.request_types import (
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GenRequest,
    PromptEntry,
    PromptLogprobsEvent,
    Slot,
    TokenEvent,
)
from legorl_jax.serve.scheduling import (
    build_inputs,
    chunk_buckets,
    row_buckets,
    step_groups,
    window_buckets,
)
from legorl_jax.serve.step import DeviceStep, StepOutputs

log = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """The prompt plus the requested completion does not fit the engine's context."""


class Engine:
    """Generation engine over `slots` rows of up to `max_len` positions whose
    K/V lives in a pool of blocks (`new_cache` builds it: [layers, kv_heads, blocks, block_size, head_dim])."""

    def __init__(
        self,
        step: DeviceStep,
        state: Any,
        new_cache: Callable[[], Any],
        *,
        slots: int,
        max_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_chunk: int = 256,
        max_prompt_chunk: int | None = None,
        max_step_pairs: int | None = None,
        prefix_caching: bool = True,
    ) -> None:
        self._step = step
        self._state = state
        # A factory, not a cache: a failed step may have consumed the donated cache.
        self._new_cache = lambda: _committed(new_cache())
        self._cache = self._new_cache()
        num_blocks, block_size = self._cache.num_blocks, self._cache.block_size
        self._blocks = BlockPool(num_blocks, block_size, prefix_caching)
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._chunks = chunk_buckets(min(max_chunk, max_len))
        # Steps that return prompt logprobs build [rows, chunk, vocab] logits: smaller chunks.
        self._prompt_chunks = chunk_buckets(min(max_prompt_chunk or max_chunk, max_chunk, max_len))
        self._slots: list[Slot | None] = [None] * slots
        self._rows = row_buckets(slots)
        self._windows = window_buckets(self._blocks.blocks_for(max_len), block_size)
        self._max_pairs = max_step_pairs
        self._waiting: deque[GenRequest] = deque()
        self._cond = threading.Condition()
        self._paused = False
        self._draining = False
        self._stepping = False
        self._stopping = False
        self._failure: str | None = None  # why the loop died, if it did
        self._epoch = 0
        self.weight_version = 0
        # The label each sampled token carries (vLLM's POST /update_weight_version; "default" until set).
        self.version_label = "default"
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "finished": 0}
        self._thread = threading.Thread(target=self._loop, name="legorl-engine", daemon=True)

    # ----- lifecycle ---------------------------------------------------------
    def start(self) -> Engine:
        self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        self._fail_all("engine shut down")

    @property
    def healthy(self) -> bool:
        """The loop is running: what `/health` reports."""
        return self._thread.is_alive() and self._failure is None

    # ----- requests ----------------------------------------------------------
    def validate(self, prompt: list[int], max_tokens: int | None) -> int:
        """Checks a prompt's ids and length; returns the effective max_tokens.
        Raises ContextLengthError or ValueError."""
        if not prompt:
            # vLLM's words; an empty prompt would sample from a padding row.
            raise ValueError("The decoder prompt cannot be empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        prompt_len = len(prompt)
        room = self.max_len - prompt_len
        wanted = prompt_len + (max_tokens or 0)
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_len} tokens. However, you requested "
                f"{wanted} tokens ({prompt_len} in the prompt, {max_tokens or 0} in the completion). "
                "Please reduce the length of the prompt or completion."
            )
        max_tokens = room if max_tokens is None else max_tokens
        pool = self._blocks
        if pool.blocks_for(prompt_len + max_tokens) > pool.capacity:
            raise ContextLengthError(
                f"The KV cache holds {pool.capacity * pool.block_size} tokens; this request needs "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion."
            )
        return max_tokens

    def submit(self, request: GenRequest) -> None:
        self.validate(request.prompt, request.params.max_tokens)
        with self._cond:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            if self._failure is not None:
                raise RuntimeError(f"engine is not running: {self._failure}")
            self._waiting.append(request)
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        """Ends a request (client went away); it gets no further events."""
        with self._cond:
            self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
            for i, slot in enumerate(self._slots):
                if slot is not None and slot.request.request_id == request_id:
                    self._vacate(i)

    # ----- weights and pausing ----------------------------------------------
    def pause(self, mode: PauseMode) -> None:
        """abort: end in-flight requests now; wait: let them finish first;
        keep: freeze them where they are. Returns once no step is running, or,
        called from a request's sink (the loop's own thread, mid-step), at once:
        no further step starts, so a request can be frozen after an exact token."""
        with self._cond:
            if mode == "abort":
                self._finish_all("abort")
            if mode == "wait":
                self._draining = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._stopping or not any(self._slots))
                self._draining = False
            self._paused = True
            if threading.current_thread() is not self._thread:
                self._cond.wait_for(lambda: not self._stepping)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def swap_weights(self, state: Any) -> int:
        """Installs new weights (same architecture) and returns the new version.
        Every in-flight request recomputes its K/V under the new weights."""
        with self._cond:
            self._cond.wait_for(lambda: not self._stepping)
            self._state = state
            self.weight_version += 1
            self._invalidate_cache()
            return self.weight_version

    def set_version_label(self, label: str) -> None:
        """Labels the weights for every token sampled from now on; the caller
        sets it while paused, so no token of the new weights has the old label."""
        with self._cond:
            self.version_label = label

    def reset_cache(self) -> int:
        """Drops all cached K/V; kept requests recompute it. Returns slots reset."""
        with self._cond:
            self._cond.wait_for(lambda: not self._stepping)
            return self._invalidate_cache()

    def _invalidate_cache(self) -> int:
        self._epoch += 1
        self._blocks.reset()
        active = [s for s in self._slots if s is not None]
        for slot in active:
            slot.cached, slot.registered = 0, (0, None)
        return len(active)

    def stats(self) -> dict[str, int]:
        with self._cond:
            pool = self._blocks
            return {
                **self.counters,
                "running": sum(s is not None for s in self._slots),
                "waiting": len(self._waiting),
                "slots": len(self._slots),
                "kv_blocks_used": pool.used,
                "kv_blocks_total": pool.capacity,
                "prefix_cache_queries": pool.queried_tokens,
                "prefix_cache_hits": pool.hit_tokens,
                "weight_version": self.weight_version,
                "paused": int(self._paused),
            }

    # ----- the loop ----------------------------------------------------------
    def _ready(self) -> bool:
        return self._stopping or (
            not self._paused and (any(self._slots) or (bool(self._waiting) and not self._draining))
        )

    def _admit(self) -> None:
        """Fills free slots in arrival order while the pool has blocks for the
        next request; the rest wait, so memory never grows past the pool."""
        for i, slot in enumerate(self._slots):
            if slot is not None or not self._waiting or self._draining:
                continue
            req = self._waiting[0]
            want_prompt = req.params.prompt_logprobs is not None
            # Prompt logprobs need every prompt position's logits: no prefix reuse.
            got = self._blocks.allocate(req.prompt, len(req.prompt) + req.params.max_tokens, reuse=not want_prompt)
            if got is None:
                return
            self._waiting.popleft()
            blocks, hit = got
            self._slots[i] = Slot(req, list(req.prompt), blocks, hit, [] if want_prompt else None)
            self.counters["prompt_tokens"] += len(req.prompt)

    def _loop(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # whatever ends the loop, no request may wait on it
            log.exception("engine loop died")
            failure = f"engine loop died: {exc!r}"
            with self._cond:
                self._failure = failure
                self._stepping = False
            self._fail_all(failure)

    def _iterate(self) -> bool:
        """Admits waiting requests and runs one step; False once stopping."""
        with self._cond:
            self._cond.wait_for(self._ready)
            if self._stopping:
                return False
            self._admit()
            slots = list(self._slots)
            epoch, state = self._epoch, self._state
            self._stepping = True
        try:
            self._run_step(slots, epoch, state)
        except Exception as exc:  # a failed step fails its own requests, never the engine
            log.exception("engine step failed")
            # The device step may have consumed the donated cache. Every slot
            # with K/V in it was in this step and is failed here.
            self._fail_slots(f"engine step failed: {exc}")
            self._cache = self._new_cache()
            with self._cond:
                self._blocks = BlockPool(self._blocks.num_blocks, self._blocks.block_size, self._blocks.caching)
        finally:
            with self._cond:
                self._stepping = False
                self._cond.notify_all()
        return True

    def _run_step(self, slots: list[Slot | None], epoch: int, state: Any) -> None:
        for group in step_groups(slots):
            self._run_group([slots[i] for i in group], group, epoch, state)  # type: ignore[misc]

    def _run_group(self, active: list[Slot], indices: list[int], epoch: int, state: Any) -> None:
        want_top = any((s.request.params.logprobs or 0) > 0 for s in active)
        want_prompt = any(s.wants_prompt_logprobs for s in active)
        chunks = self._prompt_chunks if want_prompt else self._chunks
        inputs, fed = build_inputs(active, chunks, self._rows, self._windows, self._blocks.block_size, self._max_pairs)
        self._cache, out = self._step(state, self._cache, inputs, want_top, want_prompt)
        with self._cond:
            self.counters["steps"] += 1
            if epoch == self._epoch:
                self._apply(indices, active, fed, inputs.positions, out)

    def _apply(
        self, indices: list[int], active: list[Slot], fed: list[int], positions: np.ndarray, out: StepOutputs
    ) -> None:
        """Step row r ran slot indices[r]."""
        for row, (index, slot) in enumerate(zip(indices, active, strict=True)):
            # A slot aborted (or replaced) during the step is skipped.
            if self._slots[index] is not slot:
                continue
            if slot.wants_prompt_logprobs and out.prompt_logprob is not None:
                self._collect_prompt_logprobs(slot, row, fed[row], positions, out)
            slot.cached += fed[row]
            slot.registered = self._blocks.register(slot.blocks, slot.tokens, slot.cached, *slot.registered)
            if slot.cached < len(slot.tokens):
                continue
            self._emit_token(index, row, slot, out)

    def _collect_prompt_logprobs(self, slot: Slot, row: int, n: int, positions: np.ndarray, out: StepOutputs) -> None:
        entries = slot.prompt_entries
        logprob, rank, top_ids, top_logprobs = (
            out.prompt_logprob,
            out.prompt_rank,
            out.prompt_top_ids,
            out.prompt_top_logprobs,
        )
        assert entries is not None and logprob is not None and rank is not None
        assert top_ids is not None and top_logprobs is not None
        n_prompt, k = len(slot.request.prompt), slot.request.params.prompt_logprobs or 0
        for t in range(n):
            # Position p scores prompt token p + 1. Positions recomputed after a
            # cache reset already have their entry and are skipped.
            if positions[row, t] == len(entries) and positions[row, t] + 1 < n_prompt:
                top = list(zip(top_ids[row, t, :k].tolist(), top_logprobs[row, t, :k].tolist(), strict=True))
                entries.append(PromptEntry(float(logprob[row, t]), int(rank[row, t]), top))
        if slot.cached + n >= n_prompt:
            slot.request.sink(PromptLogprobsEvent(entries))
            slot.prompt_entries = None

    def _emit_token(self, index: int, row: int, slot: Slot, out: StepOutputs) -> None:
        params = slot.request.params
        token = int(out.token[row])
        top = None
        if params.logprobs and out.top_ids is not None and out.top_logprobs is not None:
            k = params.logprobs
            top = list(zip(out.top_ids[row, :k].tolist(), out.top_logprobs[row, :k].tolist(), strict=True))
        slot.tokens.append(token)
        self.counters["generation_tokens"] += 1
        slot.request.sink(TokenEvent(token, float(out.logprob[row]), top, self.version_label))
        if token in params.stop_token_ids:
            self._finish(index, FinishEvent("stop", token))
        elif token in self.eos_token_ids and not params.ignore_eos:
            self._finish(index, FinishEvent("stop"))
        elif slot.generated >= params.max_tokens or len(slot.tokens) >= self.max_len:
            self._finish(index, FinishEvent("length"))

    def _finish(self, row: int, event: FinishEvent) -> None:
        slot = self._vacate(row)
        self.counters["finished"] += 1
        if slot is not None:
            slot.request.sink(event)

    def _vacate(self, row: int) -> Slot | None:
        """Empties a slot and returns its blocks to the pool (call under the lock)."""
        slot = self._slots[row]
        self._slots[row] = None
        if slot is not None:
            self._blocks.release(slot.blocks)
        return slot

    def _finish_all(self, reason: FinishReason) -> None:
        for row, slot in enumerate(self._slots):
            if slot is not None:
                self._finish(row, FinishEvent(reason))
        while self._waiting:
            self._waiting.popleft().sink(FinishEvent(reason))

    def _fail_slots(self, message: str) -> None:
        """Ends every request in a slot with an error; waiting ones stay queued."""
        with self._cond:
            requests = [s.request for s in self._slots if s is not None]
            for row in range(len(self._slots)):
                self._vacate(row)
            self._cond.notify_all()
        _send_errors(requests, message)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            requests = [s.request for s in self._slots if s is not None] + list(self._waiting)
            for row in range(len(self._slots)):
                self._vacate(row)
            self._waiting.clear()
            self._cond.notify_all()
        _send_errors(requests, message)


def _send_errors(requests: list[GenRequest], message: str) -> None:
    for req in requests:
        try:
            req.sink(ErrorEvent(message))
        except Exception:  # one closed sink must not keep the error from the others
            log.exception("could not send an error to request %s", req.request_id)


def _committed(cache: Any) -> Any:
    """Places a fresh cache on the device the way step outputs are placed; an
    uncommitted input would make every step shape compile a second time."""
    return jax.device_put(cache, jax.devices()[0])
