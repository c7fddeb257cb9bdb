"""Per-request service-level objectives (seconds) and how a finished request is judged."""

from __future__ import annotations

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
