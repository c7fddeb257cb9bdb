"""PredictorBridge: Sluice's length predictor for a scheduler that must never wait on it.

vLLM calls `schedule()` synchronously in its engine loop, so the predictor's gRPC calls run on
an asyncio loop in a daemon thread, with Sluice's own client and rules (the live scheduler's
`scheduler_service/live/predictor_link.py`):

    ask(request_id, prompt_ids, max_tokens)   -> returns at once; a background Predict with the
                                                  deadline; the request meanwhile counts as
                                                  max_tokens long (fail-open)
    answers()                                 -> the predictions that came back since the last
                                                  call (the scheduler re-files those requests)
    observe(request_id, prompt_ids, n, natural) -> returns at once; Observe in the background, so
                                                  the predictor's history learns vLLM's lengths

A predictor that is down, slow or wrong costs nothing but the fallback: failures are counted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Sequence

from sluice.common.predictor_client import PredictorClient

log = logging.getLogger("sluice_vllm.predictor")


class PredictorBridge:
    def __init__(self, target: str, timeout_s: float, model: str = "") -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.model = model
        self.counters: Counter[str] = Counter()
        self._answers: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._client: PredictorClient | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-predictor", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._client = PredictorClient(self.target, on_failure=self._failed)
        self._ready.set()
        self._loop.run_forever()

    def _failed(self, reason: str) -> None:
        self.counters[f"predict_failed_{reason}"] += 1

    def ask(self, request_id: str, prompt_ids: Sequence[int], max_tokens: int) -> None:
        if self._client is None:
            self.counters["predict_failed_unavailable"] += 1
            return
        self.counters["predict_asked"] += 1
        asyncio.run_coroutine_threadsafe(self._ask(request_id, list(prompt_ids), max_tokens), self._loop)

    async def _ask(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        assert self._client is not None
        pred = await self._client.predict(request_id, prompt, self.model, max_tokens, timeout_s=self.timeout_s)
        if pred is None:
            return  # counted by _failed; the fallback length stays
        with self._lock:
            self._answers.append((request_id, max(1, int(pred.tokens))))

    def answers(self) -> list[tuple[str, int]]:
        if not self._answers:
            return []
        with self._lock:
            out, self._answers = self._answers, []
        self.counters["predict_answered"] += len(out)
        return out

    def observe(self, request_id: str, prompt_ids: Sequence[int], true_tokens: int, natural: bool) -> None:
        client = self._client
        if client is None:
            return
        self.counters["observed"] += 1
        prompt = list(prompt_ids)

        def send() -> None:
            client.observe(request_id, prompt, self.model, true_tokens, natural)

        self._loop.call_soon_threadsafe(send)

    def close(self) -> None:
        client = self._client
        if client is None or not self._loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(client.close(), self._loop).result(timeout=3.0)
        except Exception as exc:  # shutting down: nothing left to protect
            log.debug("predictor client close: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
