"""LiveScheduler: the simulator's Cluster over real workers, fed by clients.

    start():   RemoteWorker.connect per worker (Info, Warmup) -> cluster_spec (KV sizes from
               Warmup, the cost model from the workers' model and hardware or a profile)
               -> build_cluster, the simulator's builder -> one WorkerLoop task per worker
    submit():  intake.check_request (sizes, ranges) -> healthy worker / queue bound -> a text
               prompt tokenized on a thread (the GIL released) -> intake.build_request ->
               duplicate id / healthy worker / queue bound again -> RequestStream registered
               (with its owner: the caller's identity) -> Cluster.submit -> settle
    loops:     deliver(tokens): the step's text decoded in one batch on a thread; streams get
               ids and text; a stop string -> Cluster.finish
    settle():  Cluster.pop_ended -> final messages; loops with work are woken
    abort():   the owner only; Cluster.abort (blocks free now, the worker is told next step) -> settle
    failures:  worker_lost -> Cluster.mark_down (recompute on the others, or end UNAVAILABLE
               when none is left); worker_back -> mark_up
    transfers: a disaggregated cluster (some worker's role is prefill or decode, as its Info
               announced) issues KV transfers; settle() starts one task each (live/transfers.py:
               OfferKv on the prefill worker, PullKv on the decode worker, complete_transfer)
    scaling:   add_worker(address): connect (Info, Warmup), checked against what is served ->
               Cluster.add_worker -> a new WorkerLoop; remove_worker(address): the loop retires
               between two steps -> Cluster.remove_worker (its requests move as a lost
               worker's do) -> lease ended. WorkerDiscovery (discovery.py) calls both.

One event loop owns all of this; nothing here blocks: tokenizing and detokenizing run on
threads with the GIL released (sluice.common.tokenizer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from scheduler_service.cluster import ClusterSpec, DisaggCluster, WorkerSpec, build_cluster
from scheduler_service.cluster.deployment import cluster_spec as deployment_cluster_spec
from scheduler_service.cluster.length_sources import GivenLengths
from scheduler_service.core.admission import (
    ADMITTED,
    COLD_SEQS,
    Decision,
    QueueView,
    SpeedFit,
    StepSpeed,
    decide,
    decide_cold,
    estimate,
)
from scheduler_service.core.offline import Room, is_offline
from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.slo import SLOClass, request_tbt_slo
from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_worker_cost_model
from scheduler_service.live.config import LiveConfig
from scheduler_service.live.discovery import WorkerDiscovery
from scheduler_service.live.intake import Limits, build_request, check_id, check_request, slo_of
from scheduler_service.live.loop import WorkerLoop
from scheduler_service.live.observe import LiveMetrics
from scheduler_service.live.predictor_link import PredictorLink
from scheduler_service.live.remote import RemoteWorker, WarmupOptions, WorkerCapacity, WorkerLost
from scheduler_service.live.stream import RequestStream
from scheduler_service.live.transfers import KVTransfers
from scheduler_service.live.validate import check_live_config
from sluice.common.grpc_server import KEEPALIVE, Keepalive
from sluice.common.predictor_client import PredictorClient
from sluice.common.prom import ServingMetrics
from sluice.common.security import ANONYMOUS, PLAINTEXT, ClientSecurity
from sluice.contract.plan import StepPlan
from sluice.contract.profile import BatchShape
from sluice.contract.sampling import InvalidRequestError
from sluice.v1 import generation_pb2

log = logging.getLogger(__name__)


class Rejected(Exception):
    """Admission refused for a reason of the live state (queue full, no worker, duplicate)."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class NotOwner(Exception):
    """Abort of a request another caller made (PERMISSION_DENIED)."""


# Steps with at most this many tokens are detokenized on the event loop: about 50 us per
# token with the demo tokenizer, less than the ~85 us of a hop to a thread and back.
INLINE_DETOKENIZE_TOKENS = 2
# Text prompts of this many characters or more are encoded on a lane of their own (about 10 ms
# of the tokenizer's time and up: the short requests' lane never waits for one).
LARGE_PROMPT_CHARS = 64 * 1024


def load_tokenizer(model: str, path: str | None) -> object | None:
    """The worker's own tokenizer file (sluice.common.tokenizer is torch-free), or None when
    the `tokenizers` package or the file is missing: then only token-id prompts are served."""
    try:
        from sluice.common.tokenizer import Tokenizer
    except ImportError as exc:
        log.warning("no tokenizer (%s): text prompts will be refused", exc)
        return None
    try:
        return Tokenizer(path) if path else Tokenizer.for_model(model)
    except (FileNotFoundError, OSError, ValueError) as exc:
        log.warning("no tokenizer for %s (%s): text prompts will be refused", model, exc)
        return None


def served_context_len(cfg: LiveConfig, caps: Sequence[WorkerCapacity]) -> int:
    """One rule for the longest sequence served: the smallest the workers report, the
    configured max_model_len, and (as vLLM rules) a configured max_num_batched_tokens smaller
    than those, since a policy that does not chunk prefills must fit a whole prompt in a step."""
    length = min([c.max_model_len for c in caps] + [cfg.max_model_len or caps[0].max_model_len])
    if cfg.max_num_batched_tokens is not None and cfg.max_num_batched_tokens < length:
        log.warning(
            "max_num_batched_tokens (%d) is smaller than the context length (%d): prompt + output is "
            "limited to %d tokens (raise max_num_batched_tokens, or give a chunking policy its own budget)",
            cfg.max_num_batched_tokens,
            length,
            cfg.max_num_batched_tokens,
        )
        length = cfg.max_num_batched_tokens
    return length


def prior_speed(cost_model: CostModel) -> StepSpeed:
    """The step speed admission assumes before a worker has run steps: the cost model's
    (a fitted profile's when given, else the analytic roofline)."""
    base = cost_model.iteration_time(BatchShape(num_decodes=1, decode_context_sum=1, decode_context_max=1))
    per_token = max(0.0, (cost_model.prefill_time(1024) - cost_model.prefill_time(64)) / 960)
    return StepSpeed(base, per_token)


def queue_view(
    sched: Scheduler,
    in_flight: tuple[tuple[int, float], ...] = (),
    recent_prefill: float = 0.0,
    without_offline: bool = False,
) -> QueueView:
    """What admission needs of one worker's queue (running, swapped and kept requests count as
    running: they hold seats); `in_flight`: (tokens, seconds running) of its steps not answered;
    `without_offline`: offline requests left out (they yield to online ones: core/offline.py)."""
    held = [*sched.running.values(), *sched.swapped.values(), *sched.kept.values()]
    waiting = list(sched.waiting.values())
    if without_offline:
        held = [r for r in held if not is_offline(r)]
        waiting = [r for r in waiting if not is_offline(r)]
    return QueueView(
        running_left=tuple(r.remaining_output_estimate for r in held),
        running_prefill=sum(r.num_tokens_to_compute for r in held if r.is_prefill),
        waiting_prompts=tuple(r.num_tokens_to_compute for r in waiting),
        waiting_outputs=tuple(r.remaining_output_estimate for r in waiting),
        max_num_seqs=sched.config.max_num_seqs,
        token_budget=sched.config.max_num_batched_tokens,
        in_flight=in_flight,
        recent_prefill=recent_prefill,
    )


def cluster_spec(cfg: LiveConfig, caps: Sequence[WorkerCapacity], max_model_len: int) -> ClusterSpec:
    """The cluster the workers' Info and Warmup answers describe, under this configuration:
    the cost model is fitted from `cfg.profile` when given, else the analytic roofline of the
    model and hardware the first worker described (all workers serve the same model)."""
    first = caps[0]
    return deployment_cluster_spec(
        cfg,
        [WorkerSpec(c.num_gpu_blocks, c.num_cpu_blocks, c.block_size, c.role) for c in caps],
        build_worker_cost_model(first.model_spec, first.hardware, cfg.profile),
        max_model_len,
        GivenLengths(),
        int8_swap=cfg.int8_swap and all(c.int8_swap for c in caps),
        int8_transfer=cfg.int8_transfer and all(c.int8_swap for c in caps),  # NOTE: one int8 codec for both
    )


class LiveScheduler:
    def __init__(
        self,
        addresses: Sequence[str],
        config: LiveConfig | None = None,
        serving: ServingMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        security: ClientSecurity = PLAINTEXT,
        keepalive: Keepalive = KEEPALIVE,
        discovery: WorkerDiscovery | None = None,
    ) -> None:
        """`security`: how the workers are dialled (TLS files, their API key); `keepalive`:
        the channel settings of the worker connections (tests shorten them); `discovery`: keeps
        the worker set equal to what it resolves, from start() to close()."""
        if not addresses:
            raise ValueError("the scheduler needs at least one worker address")
        self.addresses = list(addresses)
        self.config = config or LiveConfig()
        check_live_config(self.config)
        self.serving = serving
        self.clock = clock
        self.security = security
        self.keepalive = keepalive
        self.name = ""  # host:port we serve on; the workers' leases record it (SchedulerServer sets it)
        self.started = False
        self.waiting_for = "connecting to its workers"  # what start() waits for (UNAVAILABLE says it)
        self.streams: dict[str, RequestStream] = {}
        self.loops: dict[int, WorkerLoop] = {}
        self.on_health: Callable[[bool], None] | None = None
        self._tasks: list[asyncio.Task] = []
        self.closing = False
        self.started_at = 0.0
        self.num_tokens_out = 0
        self.num_tokenizing = 0  # text prompts on the tokenizer thread: they count as waiting
        self.predictor: PredictorLink | None = None
        self.discovery = discovery
        # NOTE: three pools: a long prompt being encoded never delays a step's detokenizing,
        # and prompts of LARGE_PROMPT_BYTES or more have a lane of their own, so two huge ones
        # cannot hold every encoder thread while short requests wait behind them.
        self._encode_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sluice-encode")
        self._encode_large_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-encode-large")
        self._decode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-decode")
        self._decode_lock = asyncio.Lock()
        self.transfers = KVTransfers(self)
        self._refusal = ""  # why admission refused the request being submitted
        self._last_tbt_s: float | None = None  # the TBT SLO of the last online request (offline room)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        cfg = self.config
        remotes = [self._remote(w, addr) for w, addr in enumerate(self.addresses)]
        remotes, caps = await self._connect_all(remotes, self._warmup_options())
        self._check_alike(caps)
        self._build(caps)
        for remote, cap in zip(remotes, caps, strict=True):
            self.loops[remote.worker_id] = WorkerLoop(self, remote, cap)
        self.started_at = self.clock()
        self.started = True
        self._tasks = [asyncio.create_task(loop.run(), name=f"sluice-worker-{w}") for w, loop in self.loops.items()]
        if self.discovery is not None:
            self._tasks.append(asyncio.create_task(self.discovery.run(self), name="sluice-discovery"))
        log.info(
            "live scheduler config: %s; cost model %s on %s; workers: %s",
            asdict(cfg),
            self.spec.cost_model.name,
            self.spec.cost_model.hardware.name,
            [(c.model, c.num_gpu_blocks, c.num_cpu_blocks, c.hardware.name) for c in caps],
        )

    async def _connect_all(
        self, remotes: list[RemoteWorker], warmup: WarmupOptions
    ) -> tuple[list[RemoteWorker], list[WorkerCapacity]]:
        """Info and Warmup of every worker at start. A listed (`--worker`) worker that cannot be
        had is fatal; a discovered one is left for discovery to add later (it may have gone since
        it was resolved), as long as one worker is had. Ids follow the workers kept."""
        timeout = self.config.connect_timeout_s
        results = await asyncio.gather(*(r.connect_patiently(warmup, timeout) for r in remotes), return_exceptions=True)
        failed = [(r, e) for r, e in zip(remotes, results, strict=True) if isinstance(e, BaseException)]
        static = self.discovery.static if self.discovery is not None else None
        fatal = [e for r, e in failed if static is None or r.address in static or not isinstance(e, WorkerLost)]
        if fatal or len(failed) == len(remotes):
            await asyncio.gather(*(r.close() for r in remotes))
            raise (fatal or [failed[0][1]])[0]
        for remote, exc in failed:
            log.warning("discovered worker %s not had at start (%s): discovery tries it again", remote.address, exc)
            await remote.close()
        kept = [(r, c) for r, c in zip(remotes, results, strict=True) if isinstance(c, WorkerCapacity)]
        for worker_id, (remote, _) in enumerate(kept):
            remote.worker_id = worker_id
        self.addresses = [r.address for r, _ in kept]
        return [r for r, _ in kept], [c for _, c in kept]

    def _remote(self, worker_id: int, address: str) -> RemoteWorker:
        options = self.keepalive.channel_options()
        name = self.discovery.authority(address) if self.discovery is not None else None
        if name is not None and self.security.tls is not None:
            # NOTE: a discovered worker is dialled at an IP; its certificate is checked against
            # the name that was resolved (as gRPC's own DNS resolver does), not the IP.
            options = (*options, ("grpc.ssl_target_name_override", name))
        return RemoteWorker(
            worker_id,
            address,
            self.config.step_timeout_s,
            security=self.security,
            channel_options=options,
            holder=self.name,
            on_wait=self._note_wait,
        )

    def _note_wait(self, what: str) -> None:
        self.waiting_for = what

    def _warmup_options(self) -> WarmupOptions:
        cfg = self.config
        return WarmupOptions(
            cfg.num_gpu_blocks,
            cfg.swap_space_gib,
            cfg.gpu_memory_utilization,
            cfg.max_num_batched_tokens or 0,
            cfg.max_num_seqs,
        )

    def _build(self, caps: Sequence[WorkerCapacity]) -> None:
        cfg, first = self.config, caps[0]
        self.model = first.model
        self.block_size = first.block_size
        self.max_model_len = served_context_len(cfg, caps)
        self.metrics = LiveMetrics(self.model, cfg.policy, self.serving)
        self.metrics.initialise_series([str(w) for w in range(len(caps))])
        self.spec = cluster_spec(cfg, caps, self.max_model_len)
        self.speed_prior = prior_speed(self.spec.cost_model)
        self.speeds = {w: SpeedFit(self.speed_prior) for w in range(len(caps))}
        self.cluster = build_cluster(self.spec, self.metrics, timer=time.perf_counter)
        self.cluster.offline_room = self._offline_room
        self.limits = Limits(
            max_model_len=self.max_model_len,
            max_kv_tokens=min(c.num_gpu_blocks for c in caps) * self.block_size,
            vocab_size=first.vocab_size,
            default_max_tokens=cfg.default_max_tokens,
            eos_token_ids=frozenset(first.eos_token_ids),
            max_prompt_bytes=cfg.max_prompt_bytes or 0,
        )
        self.tokenizer = load_tokenizer(self.model, cfg.tokenizer)
        self.predictor = self._predictor_link() if cfg.predictor else None

    def _predictor_link(self) -> PredictorLink:
        """The length predictor, dialled as the workers are (the same TLS files and internal key)."""
        cfg, serving = self.config, self.serving
        client = PredictorClient(
            cfg.predictor or "",
            security=self.security,
            on_failure=serving.inc_predictor_fallback if serving is not None else None,
        )
        return PredictorLink(
            client,
            self.cluster,
            self.metrics,
            self.clock,
            model=cfg.predictor_model or self.model,
            timeout_s=cfg.predictor_timeout_ms / 1e3,
            on_update=self.settle,
        )

    @staticmethod
    def _check_alike(caps: Sequence[WorkerCapacity]) -> None:
        shapes = {(c.model, c.block_size, c.vocab_size) for c in caps}
        if len(shapes) > 1:
            raise ValueError(f"workers serve different models or block sizes: {sorted(shapes)}")

    async def close(self) -> None:
        """Stops the loops; unfinished requests end UNAVAILABLE so their clients hear of it."""
        self.closing = True
        for loop in self.loops.values():
            loop.wake.set()
        pending = set(self._tasks)
        # NOTE: Python 3.11's wait_for can swallow a cancellation that lands as its inner
        # await completes (a step result arriving); the loops also check `closing`, and we
        # cancel again until every task has really ended.
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
        self._tasks = []
        await self.transfers.close()
        for rid, stream in list(self.streams.items()):
            stream.unavailable = True
            self.abort(rid, "server shutting down")
        await asyncio.gather(*(loop.remote.end_lease() for loop in self.loops.values()))
        await asyncio.gather(*(loop.remote.close() for loop in self.loops.values()))
        if self.predictor is not None:
            await self.predictor.close()
        self._encode_pool.shutdown(wait=False, cancel_futures=True)
        self._encode_large_pool.shutdown(wait=False, cancel_futures=True)
        self._decode_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ intake
    async def submit(
        self, msg: generation_pb2.GenerateRequest, *, owner: str = ANONYMOUS, request_id: str = ""
    ) -> RequestStream:
        """Admits one request; raises InvalidRequestError (bad input) or Rejected (live state).
        `request_id`: the id to use when the message names none (the x-request-id metadata)."""
        check_request(msg, self.limits)
        rid = msg.request_id or request_id
        if request_id and not msg.request_id:
            check_id(request_id, "x-request-id")
        self._check_admissible(rid, msg)
        prompt_ids = await self._prompt_ids(msg)
        now = self.clock()
        request = build_request(msg, self.limits, prompt_ids, now, rid)
        rid = request.request_id
        self._check_admissible(rid, msg, request)
        self.metrics.start_trace(request, dict(msg.labels))
        stream = RequestStream(request, self._detokenizer(request), request.sampling.stop, owner)
        self.streams[rid] = stream
        reason = self.cluster.submit(request, now, self._admission(request))
        if reason is not None:
            del self.streams[rid]
            if reason is RejectReason.SLO_UNMEETABLE:
                raise Rejected(reason, self._refusal)
            if reason is RejectReason.OFFLINE_QUEUE_FULL:
                raise Rejected(reason, self._offline_full_message())
            raise Rejected(reason, request.finish_message or str(reason))
        if (tbt_s := request_tbt_slo(request.slo, self.config.tbt_slo_s)) is not None:
            self._last_tbt_s = tbt_s  # NOTE: an admitted one's: a refused request's SLO keeps nothing
        if self.predictor is not None:
            self.predictor.ask(request)
        self.cluster.release_held(now)
        self.settle()
        return stream

    def _check_admissible(self, rid: str, msg: generation_pb2.GenerateRequest, request: Request | None = None) -> None:
        """Live-state checks, before tokenizing and again after (the state may have changed)."""
        if rid and rid in self.streams:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use by a live request")
        if not self.cluster.any_healthy:
            raise Rejected(RejectReason.NO_WORKER, "no healthy worker")
        offline = self.cluster.offline
        if offline is not None and (request.slo if request else slo_of(msg)).effective_class is SLOClass.OFFLINE:
            # NOTE: its own bound: an offline backlog never fills the online queue, nor the reverse
            if offline.full:
                now = self.clock()
                stub = request or rejected_stub(rid, msg, now)
                self.metrics.on_admission(stub, Decision(False, "offline_queue_full"), "")
                self.metrics.on_reject(stub, RejectReason.OFFLINE_QUEUE_FULL, now)
                raise Rejected(RejectReason.OFFLINE_QUEUE_FULL, self._offline_full_message())
            return
        bound = self.config.max_waiting
        if bound is not None and self.cluster.num_waiting + self.num_tokenizing >= bound:
            now = self.clock()
            self.metrics.on_reject(request or rejected_stub(rid, msg, now), RejectReason.QUEUE_FULL, now)
            raise Rejected(RejectReason.QUEUE_FULL, f"the waiting queue is full ({self.config.max_waiting} requests)")

    def _offline_full_message(self) -> str:
        return f"the offline queue is full ({self.config.max_offline_waiting} requests, max_offline_waiting)"

    def _offline_room(self, worker: int) -> Room:
        """What the worker's online requests leave idle for offline ones (core/offline.py):
        until its speed is measured, COLD_SEQS requests (as admission holds online ones); then,
        with a TBT SLO to keep (the tightest of its online requests', else the last online
        request's: online traffic comes back, and a step is never cut short), the largest batch
        whose step fits it within the admission headroom (at least one seat when no online
        request is there), and the prompt tokens a step can carry beside the decodes and prompts
        already there; every seat when there is no TBT SLO."""
        sched, cfg, fit = self.cluster.schedulers[worker], self.config, self.speeds[worker]
        seats = sched.config.max_num_seqs
        if fit.num_samples < fit.min_samples:
            return Room(min(seats, COLD_SEQS))
        held = list(sched.requests.values())
        tbts = [t for r in held if (t := request_tbt_slo(r.slo, cfg.tbt_slo_s)) is not None]
        tbt_s = min(tbts) if tbts else self._last_tbt_s
        if tbt_s is None:
            return Room(seats)
        prompt = sum(r.num_prompt_tokens for r in held)
        output = sum(max(1, r.num_output_tokens + r.remaining_output_estimate) for r in held)
        speed, budget_s = fit.speed(), tbt_s * cfg.admission_headroom
        batch = speed.max_batch(budget_s, prompt / output if held else 1.0)
        if not tbts:
            batch = max(1, batch)  # NOTE: no online request here to hold to it: offline work never stalls
        pending = sum(r.num_tokens_to_compute for r in held if r.is_prefill)
        return Room(min(seats, batch), max(0, speed.max_batch(budget_s) - len(held) - pending))

    def _admission(self, request: Request) -> Callable[[Request, int], RejectReason | None] | None:
        """SLO-aware admission (core/admission.py) as the cluster's hook: asked about the worker
        the router chose, it refuses (SLO_UNMEETABLE) a request whose TTFT or TBT SLO that
        worker's queue and measured speed say cannot be met. Offline requests (judged by JCT),
        requests without a TTFT or TBT SLO and `admission off` are admitted up to max_waiting
        (offline ones up to max_offline_waiting, in the offline queue: core/offline.py). The
        worker is estimated without its offline requests when they yield. The decision goes on
        the request's span and the admission counter."""
        slo, cfg = request.slo, self.config
        ttft_s, tbt_s = slo.ttft_s, request_tbt_slo(slo, cfg.tbt_slo_s)
        why = (
            "offline_queue"
            if self.cluster.offline is not None and slo.effective_class is SLOClass.OFFLINE
            else "off"
            if cfg.admission == "off"
            else "offline"
            if slo.effective_class is SLOClass.OFFLINE
            else "no_slo"
            if (ttft_s is None and tbt_s is None) or isinstance(self.cluster, DisaggCluster)
            else ""
        )
        if why:
            self.metrics.on_admission(request, ADMITTED, why)
            return None

        def admit(request: Request, worker: int) -> RejectReason | None:
            fit = self.speeds[worker]
            view = queue_view(
                self.cluster.schedulers[worker],
                self.loops[worker].in_flight_tokens(),
                fit.prefill_per_step,
                without_offline=self.cluster.holds_offline(worker),
            )
            prompt, output = request.num_tokens_to_compute, request.remaining_output_estimate
            decision = decide_cold(view, fit) or decide(
                estimate(view, prompt, output, fit.speed(), tbt_s and tbt_s * cfg.admission_headroom),
                ttft_s,
                tbt_s,
                cfg.admission_headroom,
            )
            self.metrics.on_admission(request, decision, "slo")
            if decision.admit:
                return None
            self._refusal = decision.describe(ttft_s, tbt_s, cfg.admission_headroom)
            return RejectReason.SLO_UNMEETABLE

        return admit

    def observe_step(self, worker_id: int, plan: StepPlan, seconds: float, seen_s: float) -> None:
        """A step's plan, the seconds the worker says it took and how long it took as seen
        here: the worker's measured speed (and recent prompt tokens) admission estimates with."""
        speed = self.speeds.get(worker_id)
        if speed is not None:
            counts = plan.num_scheduled_tokens.values()
            tokens = sum(counts)
            speed.add(tokens, seconds, seen_s, prefill=sum(n for n in counts if n > 1))

    async def _prompt_ids(self, msg: generation_pb2.GenerateRequest) -> list[int]:
        if msg.WhichOneof("prompt") != "text":
            return list(msg.token_ids.ids)
        if self.tokenizer is None:
            raise InvalidRequestError("text", "this server has no tokenizer for its model; send token_ids instead")
        self.num_tokenizing += 1
        try:
            loop = asyncio.get_running_loop()
            pool = self._encode_large_pool if len(msg.text) >= LARGE_PROMPT_CHARS else self._encode_pool
            return await loop.run_in_executor(pool, self.tokenizer.encode_unlocked, msg.text)
        finally:
            self.num_tokenizing -= 1

    def _detokenizer(self, request: Request) -> object | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.detokenizer(request.prompt_token_ids or (), request.sampling.skip_special_tokens)

    def abort(self, request_id: str, message: str = "aborted", *, owner: str | None = None) -> bool:
        """Ends a live request (idempotent): its KV is free at once, the worker is told next
        step. `owner`: the caller's identity, checked against the request's (NotOwner)."""
        stream = self.streams.get(request_id)
        if stream is None:
            return False
        if owner is not None and stream.owner != owner:
            raise NotOwner(request_id)
        self.cluster.abort(request_id, self.clock(), message)
        self.settle()
        return True

    def check_owner(self, request_ids: Sequence[str], owner: str) -> None:
        """NotOwner naming the first live id that another caller made (Abort aborts none then)."""
        for rid in request_ids:
            stream = self.streams.get(rid)
            if stream is not None and stream.owner != owner:
                raise NotOwner(rid)

    # ------------------------------------------------------------------ called by the loops
    async def deliver(self, tokens: Sequence[tuple[Request, int]], now: float) -> None:
        """The step's tokens go to their streams with the text they add (decoded off the
        event loop when the step has more than a couple of them); a stop string ends its
        request. A stream that ends while its text is decoded ends after its token."""
        live = [(self.streams[r.request_id], r, t) for r, t in tokens if r.request_id in self.streams]
        self.num_tokens_out += len(tokens)
        for stream, _, _ in live:
            stream.begin_decoding()
        try:
            texts = await self._texts(live)
        except BaseException:
            texts = [""] * len(live)
            raise
        finally:
            for (stream, request, token), text in zip(live, texts, strict=True):
                self._push(stream, request, token, text, now)
                stream.end_decoding()

    def _push(self, stream: RequestStream, request: Request, token: int, text: str, now: float) -> None:
        if len(request.output_token_ids) == 1:  # NOTE: not num_output_tokens, which counts overlap's placeholders
            self.metrics.on_first_token(request)
        if stream.push(token, text) and not request.status.is_finished:
            self.cluster.finish(request.request_id, RequestStatus.FINISHED_STOPPED, now, "stop string")

    async def _texts(self, live: Sequence[tuple[RequestStream, Request, int]]) -> list[str]:
        decoding = [(s.detokenizer, t) for s, _, t in live if s.detokenizer is not None]
        if not decoding:
            return [""] * len(live)
        if len(decoding) <= INLINE_DETOKENIZE_TOKENS:
            decoded = iter([d.add(t) for d, t in decoding])
        else:
            # NOTE: one batch at a time: a request re-routed between workers must have its ids
            # fed in order.
            from sluice.common.tokenizer import detokenize_step

            async with self._decode_lock:
                decoded = iter(await detokenize_step(self.tokenizer, decoding, self._decode_pool))
        return [next(decoded) if s.detokenizer is not None else "" for s, _, _ in live]

    def settle(self) -> None:
        """Requests that ended get their last message; every loop with work is woken (a request
        may have been placed, re-routed or released from the router's pool)."""
        self.transfers.start_issued()
        for request in self.cluster.pop_ended():
            if self.predictor is not None:
                self.predictor.observe(request)
            stream = self.streams.pop(request.request_id, None)
            if stream is not None:
                stream.finish(request)
                self.metrics.on_stream_end(request)
        for w, loop in self.loops.items():
            if self.cluster.has_work(w):
                loop.wake.set()
        if self.serving is not None:
            self._update_gauges()

    def worker_lost(self, worker_id: int, now: float) -> None:
        moved = self.cluster.mark_down(worker_id, now)
        left = sum(self.cluster.healthy.values())
        ended = [r for r in moved if r.status.is_finished]
        if left:
            log.warning(
                "worker %d down: %d requests re-queued on the %d workers left", worker_id, len(moved) - len(ended), left
            )
        else:
            log.warning("worker %d down and no worker is left: %d requests end UNAVAILABLE", worker_id, len(ended))
        for request in moved:
            trace = self.metrics.traces.get(request.request_id)
            if trace is not None:
                trace.event("worker_lost", {"worker_id": worker_id})
                trace.phase("queue")
        self.metrics.on_worker(worker_id, up=False)
        self.settle()
        self._publish_health()

    def worker_back(self, worker_id: int) -> None:
        self.cluster.mark_up(worker_id, self.clock())
        self.metrics.on_worker(worker_id, up=True)
        self.settle()
        self._publish_health()

    def readdress(self, worker_id: int, address: str) -> None:
        """The worker (re)started at `address` (a supervisor restarted it, maybe on a new port):
        the loop dials it there now, not after its backoff."""
        if address != self.addresses[worker_id]:
            log.warning("worker %d moves from %s to %s", worker_id, self.addresses[worker_id], address)
        self.addresses[worker_id] = address
        self.loops[worker_id].remote.address = address
        self.loops[worker_id].redial.set()

    def readdress_predictor(self, address: str) -> None:
        """The length predictor now listens at `address` (restarted by a supervisor on a new
        port): later requests ask it there; questions in flight to the old one fall back."""
        if self.predictor is None:
            return
        log.warning("the length predictor moves from %s to %s", self.config.predictor, address)
        self.config.predictor = address
        old = self.predictor.client
        self.predictor.client = self._predictor_link().client
        task = asyncio.get_running_loop().create_task(old.close())
        self._tasks.append(task)

    def worker_reset(self, worker_id: int) -> None:
        """The worker was warmed up again on a new session (its state wiped): the requests it
        held recompute on it; it never counted as down."""
        now = self.clock()
        self.cluster.schedulers[worker_id].reset_worker(now)
        if isinstance(self.cluster, DisaggCluster):
            self.cluster.kv_lost(worker_id, now)  # the KV it prefilled for a transfer is gone too
        self.metrics.on_reconnect(worker_id)
        self.settle()

    # ------------------------------------------------------------------ scaling
    def worker_addresses(self) -> dict[str, int]:
        """The address of every worker in the cluster now (down ones included), to its id."""
        return {loop.remote.address: w for w, loop in self.loops.items()}

    async def add_worker(self, address: str) -> int:
        """A new worker joins without a restart: connected and warmed up as at start, then
        given its own scheduler and loop. WorkerLost when it cannot be reached; ValueError when
        it serves another model or less than what is already promised to clients (context
        length, KV for the longest prompt), since admitted requests must fit every worker."""
        if self.closing:
            raise WorkerLost(f"worker {address}: the scheduler is shutting down")
        # NOTE: the id is the cluster's next one, known only after the (awaited) connect;
        # until then the remote carries -1, which only log lines read.
        remote = self._remote(-1, address)
        try:
            cap = await remote.connect_patiently(self._warmup_options(), self.config.connect_timeout_s)
            self._check_joining(address, cap)
            if self.closing:
                raise WorkerLost(f"worker {address}: the scheduler is shutting down")
        except BaseException:
            await remote.end_lease()
            await remote.close()
            raise
        spec = WorkerSpec(cap.num_gpu_blocks, cap.num_cpu_blocks, cap.block_size, cap.role)
        worker_id = self.cluster.add_worker(spec, self.clock())
        remote.worker_id = worker_id
        self.addresses.append(address)  # NOTE: ids are never reused, so addresses[id] stays the worker's
        loop = WorkerLoop(self, remote, cap)
        self.loops[worker_id] = loop
        self.speeds[worker_id] = SpeedFit(self.speed_prior)
        self._tasks.append(asyncio.create_task(loop.run(), name=f"sluice-worker-{worker_id}"))
        self.metrics.initialise_series([str(worker_id)])
        log.warning(
            "worker %d at %s joined (%d blocks): %d workers", worker_id, address, cap.num_gpu_blocks, len(self.loops)
        )
        self.settle()
        self._publish_health()
        return worker_id

    def _check_joining(self, address: str, cap: WorkerCapacity) -> None:
        served = (self.model, self.block_size, self.limits.vocab_size)
        if (cap.model, cap.block_size, cap.vocab_size) != served:
            raise ValueError(
                f"worker {address} serves {(cap.model, cap.block_size, cap.vocab_size)}, not {served} "
                "(model, block size, vocabulary)"
            )
        if cap.role != "mixed" and not isinstance(self.cluster, DisaggCluster):
            raise ValueError(
                f"worker {address} announces role {cap.role}, but this cluster was started colocated "
                "(all workers mixed): start the scheduler with its prefill and decode workers"
            )
        blocks = self.limits.max_kv_tokens // self.block_size
        if cap.max_model_len < self.max_model_len or cap.num_gpu_blocks < blocks:
            raise ValueError(
                f"worker {address} holds {cap.max_model_len} tokens of context and {cap.num_gpu_blocks} KV blocks, "
                f"less than the served {self.max_model_len} tokens and {blocks} blocks"
            )

    async def remove_worker(self, address: str) -> list[Request]:
        """The worker at `address` leaves for good: its loop ends between two steps (a lost
        worker's loop, reconnecting, at once), its requests are re-queued on the others as a
        lost worker's are (or end UNAVAILABLE when none is left), its lease is given up.
        Returns the requests it held."""
        worker_id = self.worker_addresses().get(address)
        if worker_id is None:
            return []
        loop = self.loops[worker_id]
        loop.retire()
        task = next((t for t in self._tasks if t.get_name() == f"sluice-worker-{worker_id}"), None)
        if task is not None:
            if not loop.connected:
                task.cancel()  # NOTE: reconnecting: nothing in flight, its requests already moved
            await asyncio.wait({task})
            self._tasks.remove(task)
        if worker_id not in self.loops:  # removed meanwhile by another call
            return []
        moved = self.cluster.remove_worker(worker_id, self.clock())
        del self.loops[worker_id]
        for request in moved:
            trace = self.metrics.traces.get(request.request_id)
            if trace is not None:
                trace.event("worker_removed", {"worker_id": worker_id})
                trace.phase("queue")
        self.metrics.on_worker_removed(worker_id)
        ended = sum(r.status.is_finished for r in moved)  # no worker left to take them
        log.warning(
            "worker %d at %s removed: %d requests re-queued, %d ended; %d workers left",
            worker_id,
            address,
            len(moved) - ended,
            ended,
            len(self.loops),
        )
        self.settle()
        self._publish_health()
        await loop.remote.end_lease()
        await loop.remote.close()
        return moved

    def _publish_health(self) -> None:
        if self.on_health is not None:
            self.on_health(self.is_healthy)

    def _update_gauges(self) -> None:
        assert self.serving is not None
        scheds = self.cluster.schedulers.values()
        self.serving.set_running(sum(len(s.running) for s in scheds))
        self.serving.set_waiting(self.num_waiting)
        total = sum(s.kv.gpu.num_blocks for s in scheds)
        self.serving.set_kv_usage(sum(s.kv.gpu.num_used for s in scheds) / total if total else 0.0)

    # ------------------------------------------------------------------ queries
    @property
    def is_healthy(self) -> bool:
        return self.cluster.any_healthy

    @property
    def num_waiting(self) -> int:
        """Requests not running yet, the offline queue's included."""
        return self.cluster.num_waiting + self.cluster.num_offline_queued

    def throughput_tok_s(self) -> float:
        elapsed = self.clock() - self.started_at
        return self.num_tokens_out / elapsed if elapsed > 0 else 0.0


def rejected_stub(request_id: str, msg: generation_pb2.GenerateRequest, now: float) -> Request:
    """A request refused before its prompt was tokenized, for the metrics' books."""
    return Request(request_id or "-", arrival_time=now, num_prompt_tokens=0, slo=slo_of(msg))
