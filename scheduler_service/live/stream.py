"""One request's way from the worker loops to its Generate handler.

    WorkerLoop: step's tokens --detokenize_step (one batch, on a thread)--> text deltas
                push(token, delta) --> stop-string check --> queue
                finish(request) -------------------------------------> queue (end marker)
    Generate:   async for chunk in messages(): whatever is queued becomes one message

`push` runs in the worker loop right after the step's text is decoded and before the next
step is planned, so a stop string ends the request (Scheduler.finish) with no token computed
past it. Text that could still become the start of a stop string is held back until the next
token decides; a stop string and what follows it are never sent (OpenAI semantics).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_service.core.request import Request

if TYPE_CHECKING:
    from sluice.common.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class Chunk:
    """One Generate message: new ids and text; `final` is set on the last one."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: Request | None = None


class RequestStream:
    def __init__(
        self,
        request: Request,
        detokenizer: IncrementalDetokenizer | None,
        stop: Sequence[str] = (),
        owner: str = "",
    ) -> None:
        self.request = request
        self.owner = owner  # the caller's identity (sluice.common.security): who may Abort it
        self.stop = tuple(s for s in stop if s)
        self.stopped_by_string = False
        self.done = False
        self.detokenizer = detokenizer
        self.unavailable = False  # ended by the server going away (UNAVAILABLE), not by Abort
        self._decoding = 0  # tokens of a step whose text is being decoded (they come before the end)
        self._deferred: Request | None = None
        self._held = ""  # text that may be the start of a stop string
        self._queue: asyncio.Queue[tuple[int, str] | Request] = asyncio.Queue()

    def push(self, token_id: int, delta: str = "") -> bool:
        """Adds one generated token and the text it added; True when a stop string has just
        ended the request."""
        if self.stopped_by_string:
            return True
        text = self._release(self._held + delta)
        self._queue.put_nowait((token_id, text))
        return self.stopped_by_string

    def begin_decoding(self) -> None:
        """A step's token is on its way: an end that comes meanwhile waits for it."""
        self._decoding += 1

    def end_decoding(self) -> None:
        self._decoding -= 1
        if not self._decoding and self._deferred is not None:
            request, self._deferred = self._deferred, None
            self.finish(request)

    def finish(self, request: Request) -> None:
        """The request ended (any reason); held-back text goes out unless a stop string ended it."""
        if self._decoding:
            self._deferred = request
            return
        if self.done:
            return
        self.done = True
        if self._held and not self.stopped_by_string:
            self._queue.put_nowait((-1, self._held))
        self._held = ""
        self._queue.put_nowait(request)

    async def messages(self) -> AsyncIterator[Chunk]:
        while True:
            chunk = Chunk()
            item = await self._queue.get()
            while True:
                if isinstance(item, Request):
                    chunk.final = item
                    break
                token_id, text = item
                if token_id >= 0:
                    chunk.token_ids.append(token_id)
                chunk.text += text
                if self._queue.empty():
                    break
                item = self._queue.get_nowait()
            yield chunk
            if chunk.final is not None:
                return

    def _release(self, text: str) -> str:
        """What of `text` may be sent now; the rest stays held (or is cut at a stop string)."""
        if not self.stop:
            return text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped_by_string = True
            self._held = ""
            return text[:cut]
        keep = _longest_stop_prefix_suffix(text, self.stop)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
