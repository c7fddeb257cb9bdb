"""Per-request service-level objectives (seconds) and how a finished request is judged."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from sluice.contract.sampling import InvalidRequestError


class SLOClass(StrEnum):
    ONLINE = "online"  # judged by TTFT and TBT
    OFFLINE = "offline"  # judged by JCT


@dataclass(frozen=True, slots=True)
class SLOSpec:
    ttft_s: float | None = None
    tbt_s: float | None = None
    jct_s: float | None = None
    slo_class: SLOClass | None = None

    @property
    def effective_class(self) -> SLOClass:
        if self.slo_class is not None:
            return self.slo_class
        online = self.ttft_s is not None or self.tbt_s is not None
        return SLOClass.ONLINE if online or self.jct_s is None else SLOClass.OFFLINE

    @property
    def is_empty(self) -> bool:
        return self.ttft_s is None and self.tbt_s is None and self.jct_s is None

    @property
    def iteration_slo_s(self) -> float | None:
        """The tightest per-iteration SLO (AccelGen's SLO_min input for one request)."""
        values = [v for v in (self.ttft_s, self.tbt_s) if v is not None]
        return min(values) if values else None

    def validate(self, prefix: str = "slo") -> None:
        for name in ("ttft_s", "tbt_s", "jct_s"):
            value = getattr(self, name)
            if value is not None and not value > 0.0:
                raise InvalidRequestError(f"{prefix}.{name.removesuffix('_s')}_ms", f"must be > 0, got {value!r}")


NO_SLO = SLOSpec()


def request_tbt_slo(slo: SLOSpec, deployment_tbt_s: float | None) -> float | None:
    """The TBT SLO a request is held to, live and simulated alike: its own, else the
    deployment's (`Deployment.tbt_slo_s`); none for an offline-class request, which is judged
    by its JCT alone and never constrains a step."""
    if slo.effective_class is SLOClass.OFFLINE:
        return None
    return slo.tbt_s if slo.tbt_s is not None else deployment_tbt_s


def tightest_tbt_slo(slos: Iterable[SLOSpec], deployment_tbt_s: float | None) -> float | None:
    """The tightest TBT SLO among requests (`request_tbt_slo` of each): every request of a
    batch waits for the same step, so the tightest one bounds it."""
    values = [t for slo in slos if (t := request_tbt_slo(slo, deployment_tbt_s)) is not None]
    return min(values) if values else deployment_tbt_s


class TbtSloSet:
    """The TBT SLOs of the requests a worker holds, kept as they arrive and leave, so a policy
    reads the tightest in O(1) per step (few distinct values: a recount only when the tightest
    one leaves)."""

    def __init__(self, deployment_tbt_s: float | None) -> None:
        self.deployment_tbt_s = deployment_tbt_s
        self._count: Counter[float] = Counter()
        self._held: dict[str, float] = {}
        self.tightest: float | None = deployment_tbt_s

    def add(self, request_id: str, slo: SLOSpec) -> bool:
        """Counts the request's TBT SLO; True when the tightest changed."""
        tbt = request_tbt_slo(slo, self.deployment_tbt_s)
        if tbt is None or request_id in self._held:
            return False
        self._held[request_id] = tbt
        self._count[tbt] += 1
        # NOTE: while any request is held the tightest is the least of theirs (each resolved with
        # the deployment's default already); with none held it is the deployment's
        return self._set(tbt if len(self._held) == 1 or self.tightest is None else min(self.tightest, tbt))

    def remove(self, request_id: str) -> bool:
        """Forgets the request's TBT SLO; True when the tightest changed."""
        tbt = self._held.pop(request_id, None)
        if tbt is None:
            return False
        self._count[tbt] -= 1
        if self._count[tbt]:
            return False
        del self._count[tbt]
        return self._set(min(self._count) if self._count else self.deployment_tbt_s)

    def _set(self, value: float | None) -> bool:
        changed = value != self.tightest
        self.tightest = value
        return changed


@dataclass(frozen=True, slots=True)
class SLOVerdict:
    """Each objective's outcome: True met, False missed, None not judged (no such SLO, or no
    gap between tokens to judge a TBT SLO by)."""

    ttft_met: bool | None = None
    tbt_met: bool | None = None
    jct_met: bool | None = None

    @property
    def met(self) -> bool:
        return self.ttft_met is not False and self.tbt_met is not False and self.jct_met is not False

    @property
    def missed(self) -> tuple[str, ...]:
        """The objectives missed, by name ("ttft", "tbt", "jct")."""
        outcomes = (("ttft", self.ttft_met), ("tbt", self.tbt_met), ("jct", self.jct_met))
        return tuple(name for name, met in outcomes if met is False)


def mean_token_gap(token_times: Sequence[float]) -> float | None:
    """Mean gap between consecutive tokens (DistServe's TPOT); None below two tokens. The gaps
    telescope, so it is the span over the number of gaps."""
    n = len(token_times)
    return (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None


def judge_slo(slo: SLOSpec, arrival_s: float, token_times: Sequence[float]) -> SLOVerdict:
    """Whether a request that completed met its SLOs: the one rule of the simulator's metrics,
    the live service's final timings and the benches. TTFT = first token - arrival, TBT = the
    mean gap between tokens, JCT = last token - arrival. A request that ended without
    completing (rejected, timed out, failed) has missed them; that is the caller's to say."""
    if not token_times:
        raise ValueError("judge_slo needs the token times of a completed request")
    mean_gap = mean_token_gap(token_times)
    return SLOVerdict(
        ttft_met=None if slo.ttft_s is None else token_times[0] - arrival_s <= slo.ttft_s,
        tbt_met=None if slo.tbt_s is None or mean_gap is None else mean_gap <= slo.tbt_s,
        jct_met=None if slo.jct_s is None else token_times[-1] - arrival_s <= slo.jct_s,
    )
