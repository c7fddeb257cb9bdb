"""The worker's book of what the scheduler told it, and the checks every plan must pass.

    PlanBook.check(plan) -> StagedPlan     all rules, nothing changed; StepPlanError names the
                                           request and the rule it broke
    engine releases, applies the plan      (the torch engine moves KV; the echo engine does not)
    PlanBook.commit(staged)                block tables and block owners as the plan leaves them
    PlanBook.advance(plan, sampled)        tokens computed and known after the step

Both engines (the torch `LLMEngine` and the load-test `EchoEngine`) check plans with this one
book, so a plan the echo worker accepts is one the real worker accepts. Block ownership is a
map updated with the blocks a plan adds or frees, so a check costs O(the plan's diff), not
O(all blocks held): a 256-decode step whose tables did not change reads each request once.

Rules: new requests are unknown and well formed (ids in the vocabulary, valid sampling);
cached diffs name known requests and agree on computed tokens; blocks are in range and owned
by one request (blocks freed earlier in the same plan, by a release, a swap-out or a replaced
table, may be reused); a swap-out moves the whole table; scheduled tokens stay within the known
tokens, the model's length and the request's blocks; only a request reaching the end of its
known tokens samples.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler_service.core.plan import KVMoveKind, NewRequestData, StepPlan
from scheduler_service.core.sampling import InvalidRequestError


class StepPlanError(Exception):
    """A malformed plan; raised before any state changes."""

    def __init__(self, message: str, request_id: str = "", code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(f"{message} (request {request_id!r})" if request_id else message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(slots=True)
class BookEntry:
    num_tokens: int
    num_computed_tokens: int
    gpu: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)


class PlanBook:
    def __init__(self, block_size: int, max_model_len: int, vocab_size: int | None = None) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.num_gpu_blocks = 0
        self.num_cpu_blocks = 0
        self.entries: dict[str, BookEntry] = {}
        self.gpu_owner: dict[int, str] = {}
        self.cpu_owner: dict[int, str] = {}

    def reset(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """A new KV cache: every request and block is forgotten."""
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.entries.clear()
        self.gpu_owner.clear()
        self.cpu_owner.clear()

    def release(self, request_ids: Iterable[str]) -> list[str]:
        released = []
        for rid in request_ids:
            entry = self.entries.pop(rid, None)
            if entry is not None:
                for b in entry.gpu:
                    self.gpu_owner.pop(b, None)
                for b in entry.cpu:
                    self.cpu_owner.pop(b, None)
                released.append(rid)
        return released

    def check(self, plan: StepPlan) -> StagedPlan:
        staged = StagedPlan(self, plan.release_ids)
        staged.check(plan)
        return staged

    def commit(self, staged: StagedPlan) -> None:
        """Applies a checked plan's tables (after its releases have been applied)."""
        for b in staged.freed_gpu:
            self.gpu_owner.pop(b, None)
        for b in staged.freed_cpu:
            self.cpu_owner.pop(b, None)
        self.gpu_owner.update(staged.new_gpu)
        self.cpu_owner.update(staged.new_cpu)
        for rid, state in staged.states.items():
            live = self.entries.get(rid)
            if live is None:
                self.entries[rid] = state
            else:
                live.gpu, live.cpu = state.gpu, state.cpu

    def advance(self, plan: StepPlan, sampled: Iterable[str]) -> None:
        entries = self.entries
        for rid, n in plan.num_scheduled_tokens.items():
            entries[rid].num_computed_tokens += n
        for rid in sampled:
            entries[rid].num_tokens += 1


class StagedPlan:
    """One plan's changes, checked against the book before any of them is applied."""

    def __init__(self, book: PlanBook, release_ids: Iterable[str]) -> None:
        self.book = book
        self.released = {rid for rid in release_ids if rid in book.entries}
        self.states: dict[str, BookEntry] = {}  # copies of the entries this plan changes
        self.new_gpu: dict[int, str] = {}
        self.new_cpu: dict[int, str] = {}
        self.freed_gpu: set[int] = set()
        self.freed_cpu: set[int] = set()
        self.moved_blocks = 0
        self._claims: list[tuple[str, str, tuple[int, ...]]] = []

    def _state(self, rid: str, what: str) -> BookEntry:
        state = self.states.get(rid)
        if state is None:
            live = self.book.entries.get(rid)
            if live is None or rid in self.released:
                raise StepPlanError(f"{what}: request unknown to the worker", rid)
            state = self.states[rid] = BookEntry(live.num_tokens, live.num_computed_tokens, live.gpu, live.cpu)
        return state

    def _claim(self, rid: str, blocks: Iterable[int], tier: str) -> None:
        """Records blocks a request takes; checked once every free of the plan is known."""
        self._claims.append((tier, rid, tuple(blocks)))

    def _check_claims(self) -> None:
        book = self.book
        for tier, rid, blocks in self._claims:
            num, owner, new, freed = (
                (book.num_gpu_blocks, book.gpu_owner, self.new_gpu, self.freed_gpu)
                if tier == "GPU"
                else (book.num_cpu_blocks, book.cpu_owner, self.new_cpu, self.freed_cpu)
            )
            for b in blocks:
                if not 0 <= b < num:
                    raise StepPlanError(f"{tier} block {b} out of range [0, {num})", rid)
                if b in new:
                    raise StepPlanError(f"{tier} block {b} given to both {new[b]!r} and {rid!r}", rid)
                held = owner.get(b)
                if held is not None and held != rid and b not in freed and held not in self.released:
                    raise StepPlanError(f"{tier} block {b} given to both {held!r} and {rid!r}", rid)
                new[b] = rid

    def check(self, plan: StepPlan) -> None:
        for new in plan.new_requests:
            self._check_new(new)
        self._check_cached(plan)
        self._check_moves(plan)
        self._check_scheduled(plan)
        self._check_claims()

    def _check_new(self, new: NewRequestData) -> None:
        rid = new.request_id
        if rid in self.states or (rid in self.book.entries and rid not in self.released):
            raise StepPlanError("sent as new but already known to the worker", rid)
        if len(new.prompt_token_ids) != new.num_tokens or not new.prompt_token_ids:
            raise StepPlanError(
                f"prompt_token_ids has {len(new.prompt_token_ids)} ids, num_tokens says {new.num_tokens}", rid
            )
        if not 0 <= new.num_computed_tokens <= new.num_tokens:
            raise StepPlanError(f"num_computed_tokens {new.num_computed_tokens} outside [0, num_tokens]", rid)
        vocab = self.book.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in new.prompt_token_ids):
            raise StepPlanError(f"prompt_token_ids holds an id outside [0, {vocab})", rid)
        try:
            new.sampling.validate()
        except InvalidRequestError as exc:
            raise StepPlanError(str(exc), rid) from None
        self._claim(rid, new.block_ids, "GPU")
        self.states[rid] = BookEntry(new.num_tokens, new.num_computed_tokens, list(new.block_ids), [])

    def _check_cached(self, plan: StepPlan) -> None:
        c = plan.cached_requests
        if not len(c.new_block_ids) == len(c.resumed) == len(c.num_computed_tokens) == len(c):
            raise StepPlanError("cached_requests columns differ in length")
        new_ids = {n.request_id for n in plan.new_requests} if plan.new_requests else set()
        for rid, blocks, resumed, computed in zip(
            c.request_ids, c.new_block_ids, c.resumed, c.num_computed_tokens, strict=True
        ):
            if rid in new_ids:
                raise StepPlanError("cached request sent as new in the same plan", rid)
            state = self._state(rid, "cached")
            if computed != state.num_computed_tokens:
                raise StepPlanError(f"num_computed_tokens {computed} != worker's {state.num_computed_tokens}", rid)
            if resumed:
                self.freed_gpu.update(b for b in state.gpu if b not in blocks)
                state.gpu = list(blocks)
            else:
                state.gpu = state.gpu + list(blocks)
            self._claim(rid, blocks, "GPU")

    def _check_moves(self, plan: StepPlan) -> None:
        for move in plan.kv_moves:
            rid = move.request_id
            state = self._state(rid, f"KV move {move.kind.name}")
            src, dst = list(move.src_block_ids), list(move.dst_block_ids)
            if len(src) != len(dst):
                raise StepPlanError(f"KV move {move.kind.name}: {len(src)} sources, {len(dst)} destinations", rid)
            if move.kind is KVMoveKind.SWAP_OUT:
                if src != state.gpu:
                    raise StepPlanError(f"swap-out sources {src} are not the request's block table {state.gpu}", rid)
                self._claim(rid, dst, "CPU")
                self.freed_gpu.update(src)
                state.gpu, state.cpu = [], state.cpu + dst
            elif move.kind is KVMoveKind.SWAP_IN:
                if not set(src) <= set(state.cpu) or not set(dst) <= set(state.gpu):
                    raise StepPlanError("swap-in must read the request's CPU blocks into its block table", rid)
                self.freed_cpu.update(src)
                state.cpu = [b for b in state.cpu if b not in set(src)]
            elif move.kind is KVMoveKind.COPY:
                num = self.book.num_gpu_blocks
                if any(not 0 <= b < num for b in src):
                    raise StepPlanError(f"GPU block out of range [0, {num}) among copy sources {src}", rid)
                if not set(dst) <= set(state.gpu):
                    raise StepPlanError("copy destinations must be in the request's block table", rid)
            else:
                raise StepPlanError(f"unknown KV move kind {move.kind!r}", rid)
            self.moved_blocks += len(src)

    def _check_scheduled(self, plan: StepPlan) -> None:
        book = self.book
        block_size, max_len = book.block_size, book.max_model_len
        states, live, released = self.states, book.entries, self.released
        for rid, n in plan.num_scheduled_tokens.items():
            # NOTE: read, not copied: scheduling alone changes no table (the hot path at 256 decodes)
            state = states.get(rid) or (live.get(rid) if rid not in released else None)
            if state is None:
                raise StepPlanError("scheduled request unknown to the worker", rid)
            end = state.num_computed_tokens + n
            if n < 1 or end > state.num_tokens:
                raise StepPlanError(
                    f"schedules tokens [{state.num_computed_tokens}, {end}) but {state.num_tokens} are known", rid
                )
            if end > max_len:
                raise StepPlanError(f"{end} tokens exceed max_model_len {max_len}", rid)
            if len(state.gpu) * block_size < end:
                raise StepPlanError(f"{len(state.gpu)} blocks cannot hold {end} tokens", rid)
            if rid in plan.sample_ids and end != state.num_tokens:
                raise StepPlanError("samples before the end of its known tokens", rid)
        for rid in plan.sample_ids:
            if rid not in plan.num_scheduled_tokens:
                raise StepPlanError("samples but is not scheduled", rid)
