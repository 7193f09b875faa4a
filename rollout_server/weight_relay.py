"""Relay chains: a rollout host passes a `StreamWeights` stream on to the next
host while it receives it, so the sender's link carries each version once
however many hosts there are.

A header naming `relay_to` makes this host open `StreamWeights` to
`relay_to[0]` with `relay_to[1:]`, and every message is queued for it before
this host looks at it: the chain is pipelined message by message, and a
bounded queue keeps a slow next host from making this one buffer the model.
This host failing to install (a delta for another base, a bad digest) does not
break the chain: the rest of the stream still goes on. A stream that stalls
or breaks upstream is cancelled downstream, so no host installs a torn
transfer. The sender learns which hosts serve the version from `GetStatus`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator

import grpc

from legorl_jax.core.grpc_auth import ClientSecurity
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_QUEUED = 8  # messages (up to 4 MiB each) waiting for the next host


class WeightRelay:
    """One StreamWeights stream, read once: `messages()` for this host, and each
    message forwarded to the next host of the header's relay chain, if any."""

    def __init__(
        self,
        upstream: AsyncIterable[pb.WeightChunk],
        security: ClientSecurity,
        *,
        idle_timeout_s: float | None,
        timeout_s: float = 600.0,
    ) -> None:
        self._upstream = aiter(upstream)
        self._security = security
        self._idle_timeout_s = idle_timeout_s
        self._timeout_s = timeout_s
        self._queue: asyncio.Queue[pb.WeightChunk | None] = asyncio.Queue(_QUEUED)
        self._call: asyncio.Task[pb.UpdateWeightsResponse] | None = None
        self._first = True
        self._exhausted = False
        self._ended = False  # the next host was told the stream is over

    async def messages(self) -> AsyncIterator[pb.WeightChunk]:
        """Upstream's messages, each first queued for the next host."""
        while (message := await anext(self._upstream, None)) is not None:
            await self._forward(message)
            yield message
        self._exhausted = True
        # Ended downstream now: the next host installs while this one still does.
        await self._forward_end()

    async def _forward(self, message: pb.WeightChunk) -> None:
        if self._first:
            self._first = False
            if message.WhichOneof("payload") == "header" and message.header.relay_to:
                address, rest = message.header.relay_to[0], list(message.header.relay_to[1:])
                ahead = pb.WeightChunk()
                ahead.CopyFrom(message)
                del ahead.header.relay_to[:]
                ahead.header.relay_to.extend(rest)
                message = ahead
                self._call = asyncio.create_task(self._downstream(address))
        if self._call is None or self._call.done():
            return
        # A next host that has failed takes nothing more; its error surfaces in finish().
        put = asyncio.ensure_future(self._queue.put(message))
        await asyncio.wait({put, self._call}, return_when=asyncio.FIRST_COMPLETED)
        put.cancel()

    async def _downstream(self, address: str) -> pb.UpdateWeightsResponse:
        async def queued() -> AsyncIterator[pb.WeightChunk]:
            while (message := await self._queue.get()) is not None:
                yield message

        async with self._security.channel(address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            return await stub.StreamWeights(queued(), timeout=self._timeout_s, metadata=self._security.metadata)

    async def finish(self, *, upstream_broken: bool) -> None:
        """Sends the next host the rest of the stream and waits for its reply.
        `upstream_broken`: the stream stalled or failed on its way here, so the
        next host's transfer is cancelled rather than ended as if complete.
        Never raises: a failure after this host is logged, and the sender finds
        the hosts that lack the version with GetStatus."""
        if self._call is None:
            return
        try:
            if upstream_broken:
                log.warning("weight stream broke upstream; cancelling the relay to the next host")
                return
            while not self._exhausted:
                message = await asyncio.wait_for(anext(self._upstream, None), self._idle_timeout_s)
                if message is None:
                    self._exhausted = True
                    break
                await self._forward(message)
            await self._forward_end()
            reply = await self._call
            log.info("relayed weights version %d downstream", reply.loaded_version)
        except Exception as exc:  # the next host's refusal, its death, or upstream failing while drained
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            log.warning("weight relay downstream failed: %s", detail)
        finally:
            self._call.cancel()

    async def _forward_end(self) -> None:
        if self._call is None or self._ended:
            return
        self._ended = True
        if not self._call.done():
            end = asyncio.ensure_future(self._queue.put(None))
            await asyncio.wait({end, self._call}, return_when=asyncio.FIRST_COMPLETED)
            end.cancel()
