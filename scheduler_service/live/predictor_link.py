"""PredictorLink: the live scheduler's side of the length predictor.

    submit:  the request enters the cluster at once with the client's length, else max_tokens
             ask(request) -> a background task: PredictorClient.predict (deadline `timeout_s`)
                 answered in time and the request not ended -> Cluster.update_prediction
                     (the policy re-files a waiting request; a running one uses it from then on)
                 no answer -> the fallback stays; the Prometheus counter says why
    end:     observe(request) -> PredictorClient.observe (background): the predictor's
             history learns the true length (LiveMetrics records the prediction's error in
             Prometheus and the request's span when the request ends)

NOTE: the prediction is never awaited on the request's critical path. A request that finds a
worker idle is scheduled at once on its fallback length (with no queue, no policy decision
waits for it), and one that queues is re-filed when the answer comes, which is when the order
of the queue is decided. Waiting for the predictor at intake would add its latency (10-20 ms
per uncached prompt on one CPU core) to every TTFT.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from scheduler_service.cluster import Cluster
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.live.observe import LiveMetrics
from sluice.common.predictor_client import PredictorClient

log = logging.getLogger(__name__)


class PredictorLink:
    def __init__(
        self,
        client: PredictorClient,
        cluster: Cluster,
        metrics: LiveMetrics,
        clock: Callable[[], float],
        *,
        model: str,
        timeout_s: float,
        on_update: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.cluster = cluster
        self.metrics = metrics
        self.clock = clock
        self.model = model
        self.timeout_s = timeout_s
        self.on_update = on_update  # e.g. wake the loops: a re-filed request may now go first
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_applied = 0
        self.num_late = 0  # answered after the request ended

    def ask(self, request: Request) -> None:
        task = asyncio.get_running_loop().create_task(self._ask(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ask(self, request: Request) -> None:
        prompt = _prompt_of(request)
        pred = await self.client.predict(
            request.request_id, prompt, self.model, request.max_tokens, timeout_s=self.timeout_s
        )
        if pred is None:
            return  # the client counted why (on_failure); the fallback length stays
        if not self.cluster.update_prediction(request.request_id, pred.tokens, "predictor", self.clock()):
            self.num_late += 1
            return
        self.num_applied += 1
        self.metrics.on_length_prediction(request, pred)
        if self.on_update is not None:
            self.on_update()

    def observe(self, request: Request) -> None:
        """The request ended: the predictor's history learns its true length (when it stopped on
        its own or hit max_tokens; an abort says nothing about its length)."""
        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return
        natural = request.status is RequestStatus.FINISHED_STOPPED
        self.client.observe(request.request_id, _prompt_of(request), self.model, request.num_output_tokens, natural)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()


def _prompt_of(request: Request) -> str | Sequence[int]:
    """The text when the client sent text, else the prompt's token ids (the predictor decodes
    them with the served model's tokenizer)."""
    if request.prompt_text:
        return request.prompt_text
    return list(request.prompt_token_ids or ())
