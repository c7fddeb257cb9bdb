"""KVCPipe, EconoServe's KV pipelining (seed 001, section 3.2, Figure 7): nesting dolls.

Why: exact allocation reserves a GT's whole predicted output up front, but the tail of that
allocation stays empty until the GT's last tokens. KVCPipe lends it out meanwhile.

What it does, after the time-synced batcher has started its GT groups:

    host r1, predicted RL 32 (block_size 1)      level 1: r2 (RL 16) in r1's second half
    r1 table  [ r1 own: 0..15 | lent to r2: 16..31 ]
    level 2:  [ r1 0..7 | r3 8..15 ] [ r2 16..23 | r4 24..31 ]   r3, r4 of RL 8

- A GT whose allocation has F whole blocks beyond its current tokens lends its last F//2
  blocks (`StepBuilder.lend_blocks`, which moves the tail of the host's table to the guest)
  to the queued, KV-resident GT whose predicted remaining length l satisfies
  l x (1 + buffer) <= the tokens the host writes before reaching the lent blocks, taking the
  largest such l (binary search in the GT queue's length index). Level by level (breadth
  first), every host and every new guest tries again inside its own remaining half: a
  hosting group of m GTs asks for m x 2^(k-1) guests at level k.
- A guest that finishes hands its blocks back to its host (re-allocated to the host at the
  start of the next step, drawing on the reserve so the pool cannot refuse them).
- A host that reaches its lent blocks while the guest still lives (the guest was
  under-predicted) preempts the guest by SWAP (its KV is copied to CPU memory, never
  overwritten) and takes the blocks back at once.
Block ownership never overlaps: every move goes through kvstore's block tables.
Inputs: the GT queue's resident index, the tasks' predicted remaining lengths. Configuration:
`pipe` (on/off), `buffer` (share of the guest's predicted RL kept as slack; paper 15%,
10% for BookCorpus).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler_service.core.preemption import PreemptionMode, PreemptionReason
from scheduler_service.core.request import Request
from scheduler_service.policies.econoserve.queues import GTQueue, TaskState

if TYPE_CHECKING:
    from scheduler_service.core.step_builder import StepBuilder

StartGuest = Callable[["StepBuilder", Request], None]


class KVPipe:
    def __init__(self, buffer: float, reserve_name: str, stats: Counter[str]) -> None:
        self.buffer = buffer
        self.reserve_name = reserve_name
        self.stats = stats
        self._pending: list[tuple[str, int]] = []  # (host, blocks) handed back by finished guests

    # ------------------------------------------------------------------ lending
    def lend_all(self, step: StepBuilder, hosts: list[Request], gtq: GTQueue, start_guest: StartGuest) -> list[Request]:
        """Nests guests level by level under `hosts`; `start_guest(step, guest)` moves a
        queued GT into the batch. Returns the guests started."""
        started: list[Request] = []
        level = list(hosts)
        while level and len(gtq.resident):
            next_level: list[Request] = []
            for host in level:
                guest = self._lend_once(step, host, gtq, start_guest)
                if guest is not None:
                    next_level += [host, guest]
                    started.append(guest)
            level = next_level
        return started

    def _lend_once(self, step: StepBuilder, host: Request, gtq: GTQueue, start_guest: StartGuest) -> Request | None:
        kv = step.kv
        table = kv.gpu_tables.get(host.request_id)
        if not table or not step.budget.can_fit(1):
            return None
        free = len(table) - kv.num_blocks_for(host.num_computed_tokens)
        lend = free // 2
        if lend <= 0:
            return None
        # Tokens the host writes (this step included) before it reaches the lent blocks.
        slack = (len(table) - lend) * kv.block_size - host.num_computed_tokens
        bound = min(math.floor(slack / (1.0 + self.buffer)), lend * kv.block_size)
        rid = gtq.closest_guest(bound)
        if rid is None:
            return None
        guest: Request = step.kept.get(rid) or step.running[rid]
        if kv.num_new_blocks(rid, guest.num_computed_tokens + guest.policy_state.remaining) > lend:
            return None
        step.lend_blocks(host, guest, lend)
        host_state: TaskState = host.policy_state
        guest_state: TaskState = guest.policy_state
        guest_state.host, guest_state.lent_blocks = host.request_id, lend
        host_state.guests = [*(host_state.guests or []), rid]
        start_guest(step, guest)
        self.stats["pipe_guests"] += 1
        self.stats["pipe_blocks_lent"] += lend
        return guest

    # ------------------------------------------------------------------ giving back
    def on_guest_gone(self, guest: Request, states: dict[str, TaskState]) -> None:
        """A guest finished or lost its GPU blocks: its host gets as many back next step."""
        gs: TaskState = guest.policy_state
        host = states.get(gs.host) if gs.host else None
        if host is not None and host.guests and guest.request_id in host.guests:
            host.guests.remove(guest.request_id)
            self._pending.append((gs.host, gs.lent_blocks))
        gs.host, gs.lent_blocks = None, 0

    def orphan_guests(self, host: Request, states: dict[str, TaskState]) -> None:
        """The host left the GPU: its guests keep the borrowed blocks as their own."""
        hs: TaskState = host.policy_state
        for rid in hs.guests or ():
            if rid in states:
                states[rid].host, states[rid].lent_blocks = None, 0
        hs.guests = None

    def reclaim(self, step: StepBuilder) -> None:
        """Returns the blocks of finished guests to their hosts (start of each step)."""
        kv = step.kv
        for host_id, blocks in self._pending:
            if host_id in kv.gpu_tables and (host_id in step.running or host_id in step.kept):
                target = kv.capacity(host_id) + blocks * kv.block_size
                if kv.allocate(host_id, target, self.reserve_name) is not None:
                    self.stats["pipe_blocks_reclaimed"] += blocks
        self._pending.clear()

    def evict_guests(self, step: StepBuilder, host: Request, needed_tokens: int) -> None:
        """The host needs its lent blocks back: swap out live guests, innermost first."""
        hs: TaskState = host.policy_state
        kv = step.kv
        while hs.guests and kv.capacity(host.request_id) < needed_tokens:
            rid = hs.guests.pop()
            guest = step.running.get(rid) or step.kept.get(rid)
            if guest is None:
                continue
            blocks = guest.policy_state.lent_blocks
            guest.policy_state.host, guest.policy_state.lent_blocks = None, 0
            step.preempt(guest, PreemptionMode.SWAP, PreemptionReason.KV_PRESSURE)
            self.stats["pipe_guests_swapped"] += 1
            target = kv.capacity(host.request_id) + blocks * kv.block_size
            kv.allocate(host.request_id, target, self.reserve_name)
