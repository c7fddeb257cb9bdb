"""Sluice's policies as vLLM scheduler classes:

    vllm serve MODEL --scheduler-cls sluice_vllm.scheduler.SluiceScheduler        (sync engine;
                                                          CPU forces async scheduling off)
    vllm serve MODEL --scheduler-cls sluice_vllm.scheduler.SluiceAsyncScheduler   (async engine)

with the policy named in the environment (`SLUICE_VLLM_POLICY`, sluice_vllm/config.py).

One mixin over both of vLLM's bases. Each `schedule()`: take the predictor's late answers,
apply aging, then set what the policy decides (the waiting queue's order, the running list's
order, which is vLLM's victim order, the token budget and the admission cap) and call vLLM's
own `schedule()`, which does the rest: KV allocation, chunked prefill, preemption. After each
step (`update_from_output`) the policy hears which jobs it served and how long the step took,
and the finished requests' lengths go back to the predictor (`Observe`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from operator import attrgetter
from typing import Any

from sluice_vllm.config import PluginConfig, from_env
from sluice_vllm.hints import Hints, parse_hints
from sluice_vllm.policies import Job, Limits, PluginPolicy, build_policy, describe
from sluice_vllm.predictor import PredictorBridge
from sluice_vllm.vllm_compat import (
    FINISHED_AT_LENGTH,
    FINISHED_NATURALLY,
    AsyncScheduler,
    Request,
    RequestQueue,
    RequestStatus,
    Scheduler,
    check_members,
    check_version,
)

log = logging.getLogger("sluice_vllm")
JOB = attrgetter("sluice_job")
RANK_OF_REQUEST = attrgetter("sluice_job.rank")
TRACE_EVERY_S = 2.0


class PolicyRequestQueue(RequestQueue):
    """vLLM's waiting queue, put in the policy's order once per step (`reorder`); between two
    reorders it behaves as vLLM's FCFS deque (a preempted request goes to the head)."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def reorder(self, key: Any) -> None:
        if len(self._q) > 1:
            self._q = deque(sorted(self._q, key=key))

    def add_request(self, request: Request) -> None:
        self._q.append(request)

    def pop_request(self) -> Request:
        return self._q.popleft()

    def peek_request(self) -> Request:
        if not self._q:
            raise IndexError("peek from an empty queue")
        return self._q[0]

    def prepend_request(self, request: Request) -> None:
        self._q.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._q.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        self._q.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = requests if isinstance(requests, set) else set(requests)
        self._q = deque(r for r in self._q if r not in drop)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class Trace:
    """JSON lines for people and tests: the policy at start, each request's hints as they
    arrived, the counters every few seconds and at shutdown."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115  (open for the engine's life)
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"event": event, "t": time.time(), **fields}, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class StepLog:
    """One JSON line per step (opt-in, `SLUICE_VLLM_STEP_LOG`): `t` when vLLM's schedule() was
    called (monotonic s), `p` its prefill chunks as [new tokens, tokens already computed], `d` the
    context of each decode, `left` the requests still unfinished after the step. A step whose
    `left` is not 0 is followed at once by the next one, so the gap to the next `t` is the whole
    cost of the step in the engine (forward, sampling, scheduling, output handling): the time a
    step-time profile of the served engine is fitted on. Lines are written when the engine runs
    out of requests or every `FLUSH_EVERY` steps, not per step."""

    FLUSH_EVERY = 256

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115  (open for the engine's life)
        # NOTE: a queue, not one slot: the async scheduler schedules step N+1 before step N's
        # output comes back; None stands for a step that scheduled nothing
        self._pending: deque[dict[str, Any] | None] = deque()
        self._lines: list[str] = []

    def scheduled(self, started: float, out: Any, requests: dict[str, Request]) -> None:
        if not out.total_num_scheduled_tokens:
            self._pending.append(None)
            return
        prefills: list[list[int]] = []
        decodes: list[int] = []
        for rid, n in out.num_scheduled_tokens.items():
            req = requests[rid]
            before = req.num_computed_tokens - n  # schedule() has already advanced it
            if before >= req.num_prompt_tokens:
                decodes.append(before)
            else:
                prefills.append([n, before])
        self._pending.append({"t": started, "p": prefills, "d": decodes})

    def finished(self, left: int) -> None:
        step = self._pending.popleft() if self._pending else None
        if step is not None:
            self._lines.append(json.dumps({**step, "left": left}))
        if self._lines and (left == 0 or len(self._lines) >= self.FLUSH_EVERY):
            self.flush()

    def flush(self) -> None:
        self._file.write("".join(line + "\n" for line in self._lines))
        self._file.flush()
        self._lines.clear()

    def close(self) -> None:
        self.flush()
        self._file.close()


class SluiceSchedulerMixin:
    """The plug-in over vLLM's `Scheduler` or `AsyncScheduler` (whichever follows it in the MRO)."""

    # set in __init__; declared for readers (vLLM's own attributes are in vllm_compat)
    sluice_policy: PluginPolicy
    sluice_counters: Counter[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        version = check_version()
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        check_members(self)  # type: ignore[arg-type]
        if str(self.scheduler_config.policy) != "fcfs":  # type: ignore[attr-defined]
            # vLLM's priority mode picks its own victims (max priority, arrival) over the running order
            raise ValueError(
                "sluice_vllm: leave vLLM's --scheduling-policy at fcfs; the order comes from SLUICE_VLLM_POLICY "
                "(priority is `SLUICE_VLLM_POLICY=priority`)"
            )
        self._sluice_limits = Limits(self.max_num_active_reqs, self.max_num_scheduled_tokens)  # type: ignore[attr-defined]
        self._sluice_jobs: dict[str, Job] = {}
        self._sluice_served: list[str] = []
        self._sluice_step_started = 0.0
        self._sluice_last_trace = time.monotonic()
        self.sluice_counters = Counter()
        self.sluice_config = from_env()
        self._sluice_trace = Trace(self.sluice_config.trace_path)
        path = self.sluice_config.step_log_path
        self._sluice_step_log = StepLog(path) if path else None
        self._sluice_predictor = (
            PredictorBridge(
                self.sluice_config.predictor, self.sluice_config.predictor_timeout_s, self.sluice_config.predictor_model
            )
            if self.sluice_config.predictor
            else None
        )
        self.use_policy(self.sluice_config)
        log.info("sluice_vllm: policy %s on vLLM %s (%s)", self.sluice_policy.name, version, type(self).__name__)

    # ------------------------------------------------------------------ configuration
    def use_policy(self, config: PluginConfig) -> None:
        """Installs the policy of `config` (at start; tests switch it between workloads on an
        idle engine, so several policies share one engine)."""
        if self._sluice_jobs:
            raise RuntimeError("sluice_vllm: the policy can change only while no request is in the scheduler")
        policy = build_policy(config.policy, config.options, self._sluice_limits)
        self.sluice_policy = policy
        kind = type(policy)
        # NOTE: the hooks a policy leaves as they are cost nothing per step (FCFS adds ~no work)
        self._sluice_order_key = (
            attrgetter(f"sluice_job.{policy.running_order}") if policy.running_order is not None else None
        )
        self._sluice_budgets = kind.token_budget is not PluginPolicy.token_budget
        self._sluice_caps = kind.admission_cap is not PluginPolicy.admission_cap
        self._sluice_steps = kind.on_step is not PluginPolicy.on_step
        self._sluice_times = kind.on_step_time is not PluginPolicy.on_step_time
        self._sluice_every = policy.refresh_every()
        self._sluice_pending: set[str] = set()  # served since on_step last ran
        self._sluice_pending_s = 0.0
        self._sluice_pending_steps = 0
        if policy.reorders_waiting and not isinstance(self.waiting, PolicyRequestQueue):  # type: ignore[has-type]
            self.waiting = PolicyRequestQueue()
        self.max_num_scheduled_tokens = min(
            policy.fixed_budget or self._sluice_limits.max_num_batched_tokens,
            self._sluice_limits.max_num_batched_tokens,
        )
        self.max_num_active_reqs = self._sluice_limits.max_num_seqs
        self._sluice_trace.write("start", **describe(policy))

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        started = time.perf_counter()
        if request.request_id not in self._sluice_jobs:
            extra = request.sampling_params.extra_args if request.sampling_params is not None else None
            hints, problems = parse_hints(extra)
            for problem in problems:
                self.sluice_counters["bad_hints"] += 1
                log.warning("sluice_vllm: request %s: hint dropped: %s", request.request_id, problem)
            self._sluice_add(request, hints)
        super().add_request(request)  # type: ignore[misc]
        self.sluice_counters["plugin_s"] += time.perf_counter() - started

    def _sluice_add(self, request: Request, hints: Hints) -> None:
        now = time.monotonic()
        job = Job(request, hints, now)
        self._sluice_jobs[request.request_id] = job
        request.sluice_job = job  # type: ignore[attr-defined]  (the sort keys reach it in C)
        c = self.sluice_counters
        c["requests"] += 1
        for name in hints.given:
            c[f"hint_{name}"] += 1
        if request.priority:
            c["hint_priority"] += 1
        asked = False
        if hints.predicted_tokens is None and self._sluice_predictor is not None and request.prompt_token_ids:
            self._sluice_predictor.ask(request.request_id, request.prompt_token_ids, request.max_tokens)
            asked = True
        self.sluice_policy.on_add(job, now)
        self._sluice_trace.write(
            "request",
            request_id=request.request_id,
            hints=hints.given,
            priority=request.priority,
            predicted_tokens=hints.predicted_tokens,
            asked_predictor=asked,
        )

    def _sluice_finish(self, request_id: str) -> None:
        job = self._sluice_jobs.pop(request_id, None)
        if job is None:
            return
        self.sluice_counters["finished"] += 1
        req = job.req
        if self._sluice_predictor is not None and req.status in (FINISHED_NATURALLY, FINISHED_AT_LENGTH):
            natural = req.status == FINISHED_NATURALLY
            self._sluice_predictor.observe(req.request_id, req.prompt_token_ids or [], req.num_output_tokens, natural)

    # ------------------------------------------------------------------ one step
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        now = time.monotonic()
        self._sluice_before(now)
        plugin_s = time.perf_counter() - started
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if self._sluice_step_log is not None:
            self._sluice_step_log.scheduled(now, out, self.requests)  # type: ignore[attr-defined]
        self._sluice_served = list(out.num_scheduled_tokens)
        self._sluice_step_started = time.monotonic()
        c = self.sluice_counters
        c["steps"] += 1
        c["plugin_s"] += plugin_s
        c["scheduled_tokens"] += out.total_num_scheduled_tokens
        if now - self._sluice_last_trace >= TRACE_EVERY_S:
            self._sluice_last_trace = now
            self.write_counters()
        return out

    def _sluice_before(self, now: float) -> None:
        policy, jobs = self.sluice_policy, self._sluice_jobs
        if self._sluice_predictor is not None:
            for rid, tokens in self._sluice_predictor.answers():
                job = jobs.get(rid)
                if job is not None and job.hints.predicted_tokens is None:
                    job.predicted = tokens
                    policy.on_prediction(job, now)
                    self.sluice_counters["predictions_applied"] += 1
        # NOTE: C-level keys over vLLM's lists (each request carries its Job as `sluice_job`):
        # no Python call per request per step
        running: list[Request] = self.running  # type: ignore[has-type]
        waiting = self.waiting  # type: ignore[has-type]
        if policy.reorders_waiting and waiting:
            policy.before_step(list(map(JOB, waiting)), (), now)
            waiting.reorder(RANK_OF_REQUEST)
        if self._sluice_order_key is not None and len(running) > 1:
            running.sort(key=self._sluice_order_key, reverse=policy.running_descending)
        limits = self._sluice_limits
        if self._sluice_budgets:
            running_jobs: list[Job] = list(map(JOB, running)) if policy.budget_reads_jobs else []
            waiting_jobs: list[Job] = list(map(JOB, waiting)) if policy.budget_reads_jobs else []
            budget = policy.token_budget(running_jobs, waiting_jobs, now)
            most = limits.max_num_batched_tokens
            self.max_num_scheduled_tokens = most if budget is None else min(budget, most)
        if self._sluice_caps:
            cap = policy.admission_cap()
            self.max_num_active_reqs = limits.max_num_seqs if cap is None else min(cap, limits.max_num_seqs)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        step_s = time.monotonic() - self._sluice_step_started
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        started = time.perf_counter()
        now = time.monotonic()
        jobs = self._sluice_jobs
        c = self.sluice_counters
        tokens = scheduler_output.total_num_scheduled_tokens
        if tokens:  # sums of a least-squares line step_s = a + b * tokens (benchmarks fit the price list)
            c["fit_n"] += 1
            c["fit_x"] += tokens
            c["fit_y"] += step_s
            c["fit_xx"] += tokens * tokens
            c["fit_xy"] += tokens * step_s
        if self._sluice_times:
            self.sluice_policy.on_step_time(step_s)
        if self._sluice_steps:
            self._sluice_pending.update(self._sluice_served)
            self._sluice_pending_s += step_s
            self._sluice_pending_steps += 1
            if self._sluice_pending_steps >= self._sluice_every:
                served = [jobs[rid] for rid in self._sluice_pending if rid in jobs]
                if served:
                    self.sluice_policy.on_step(served, self._sluice_pending_s, now)
                self._sluice_pending.clear()
                self._sluice_pending_s = 0.0
                self._sluice_pending_steps = 0
        for engine_outputs in outputs.values():
            for o in engine_outputs.outputs:
                if o.finish_reason is not None:
                    self._sluice_finish(o.request_id)
        if self._sluice_step_log is not None:
            self._sluice_step_log.finished(len(self.requests))  # type: ignore[attr-defined]
        self.sluice_counters["plugin_s"] += time.perf_counter() - started
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        for req in finished:
            self._sluice_finish(req.request_id)
        return finished

    # ------------------------------------------------------------------ reports
    def write_counters(self) -> None:
        counters = dict(self.sluice_counters)
        if self._sluice_predictor is not None:
            counters.update(self._sluice_predictor.counters)
        self._sluice_trace.write("counters", policy=self.sluice_policy.name, counters=counters)

    def shutdown(self) -> None:
        self.write_counters()
        if self._sluice_predictor is not None:
            self._sluice_predictor.close()
        self._sluice_trace.close()
        if self._sluice_step_log is not None:
            self._sluice_step_log.close()
        super().shutdown()  # type: ignore[misc]


class SluiceScheduler(SluiceSchedulerMixin, Scheduler):
    """Sluice's policies over vLLM's synchronous scheduler (the base on CPU)."""


class SluiceAsyncScheduler(SluiceSchedulerMixin, AsyncScheduler):
    """Sluice's policies over vLLM's async scheduler (`--async-scheduling`, CUDA)."""
