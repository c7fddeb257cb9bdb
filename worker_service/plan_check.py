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

A plan that breaks a rule on its own is INVALID_ARGUMENT; one that collides with what the book
holds from earlier plans (a block another request owns and the plan does not free, a new
request id already held) is ABORTED: the sender's view of the worker has diverged from the
book (a foreign client, or a lost step), and the scheduler re-warms the worker.

Rules: new requests are unknown and well formed (ids in the vocabulary, valid sampling);
cached diffs name known requests and agree on computed tokens; blocks are in range and held
by one request (blocks freed earlier in the same plan, by a release, a swap-out or a replaced
table, may be reused); a swap-out moves the whole table; scheduled tokens stay within the known
tokens, the model's length and the request's blocks; only a request reaching the end of its
known tokens samples.

Prefix caching: the scheduler may give one GPU block to several requests when it is a full
block whose KV is computed, read-only for all of them: a request sent with
`num_computed_tokens` = c may hold blocks of others among its first c // block_size blocks
(its cached prefix), where those others have computed them too (`readonly`: blocks inside a
holder's computed full prefix). So a block two requests hold lies inside both computed
prefixes, and no scheduled token (always past num_computed_tokens) can be written into it;
the engine computes only tokens past num_computed_tokens and attends over the shared prefix,
so a hit changes no output.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sluice.contract.plan import KVMoveKind, NewRequestData, StepPlan
from sluice.contract.sampling import InvalidRequestError


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
        self.gpu_holders: dict[int, set[str]] = {}
        self.cpu_owner: dict[int, str] = {}
        self.readonly: set[int] = set()  # GPU blocks inside a holder's computed full prefix

    @property
    def gpu_owner(self) -> dict[int, str]:
        """Block -> holder, for blocks with one holder (a view for tests and tools)."""
        return {b: next(iter(h)) for b, h in self.gpu_holders.items() if len(h) == 1}

    def reset(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """A new KV cache: every request and block is forgotten."""
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.entries.clear()
        self.gpu_holders.clear()
        self.cpu_owner.clear()
        self.readonly.clear()

    def release(self, request_ids: Iterable[str]) -> list[str]:
        released = []
        for rid in request_ids:
            entry = self.entries.pop(rid, None)
            if entry is not None:
                for b in entry.gpu:
                    self._drop_holder(b, rid)
                for b in entry.cpu:
                    self.cpu_owner.pop(b, None)
                released.append(rid)
        return released

    def _drop_holder(self, block: int, rid: str) -> None:
        holders = self.gpu_holders.get(block)
        if holders is None:
            return
        holders.discard(rid)
        if not holders:
            del self.gpu_holders[block]
            self.readonly.discard(block)

    def check(self, plan: StepPlan) -> StagedPlan:
        staged = StagedPlan(self, plan.release_ids)
        staged.check(plan)
        return staged

    def commit(self, staged: StagedPlan) -> None:
        """Applies a checked plan's tables (after its releases have been applied)."""
        for b, rid in staged.freed_gpu:
            self._drop_holder(b, rid)
        for b in staged.freed_cpu:
            self.cpu_owner.pop(b, None)
        holders = self.gpu_holders
        for b, claimers in staged.new_gpu.items():
            holders.setdefault(b, set()).update(claimers)
        self.readonly.update(staged.new_readonly)
        self.cpu_owner.update(staged.new_cpu)
        for rid, state in staged.states.items():
            live = self.entries.get(rid)
            if live is None:
                self.entries[rid] = state
            else:
                live.gpu, live.cpu = state.gpu, state.cpu

    def advance(self, plan: StepPlan, sampled: Iterable[str]) -> None:
        entries, size, readonly = self.entries, self.block_size, self.readonly
        for rid, n in plan.num_scheduled_tokens.items():
            entry = entries[rid]
            before = entry.num_computed_tokens // size
            entry.num_computed_tokens += n
            after = entry.num_computed_tokens // size
            if after > before:  # blocks this step filled are now read-only
                readonly.update(entry.gpu[before:after])
        for rid in sampled:
            entries[rid].num_tokens += 1


class StagedPlan:
    """One plan's changes, checked against the book before any of them is applied."""

    def __init__(self, book: PlanBook, release_ids: Iterable[str]) -> None:
        self.book = book
        self.released = {rid for rid in release_ids if rid in book.entries}
        self.states: dict[str, BookEntry] = {}  # copies of the entries this plan changes
        self.new_gpu: dict[int, dict[str, bool]] = {}  # block -> {claimer: claims it read-only}
        self.new_readonly: set[int] = set()
        self.new_cpu: dict[int, str] = {}
        self.freed_gpu: set[tuple[int, str]] = set()  # (block, the holder that lets it go)
        self.freed_cpu: set[int] = set()
        self.moved_blocks = 0
        self._claims: list[tuple[str, str, tuple[int, ...], int]] = []

    def _state(self, rid: str, what: str) -> BookEntry:
        state = self.states.get(rid)
        if state is None:
            live = self.book.entries.get(rid)
            if live is None or rid in self.released:
                raise StepPlanError(f"{what}: request unknown to the worker", rid)
            state = self.states[rid] = BookEntry(live.num_tokens, live.num_computed_tokens, live.gpu, live.cpu)
        return state

    def _claim(self, rid: str, blocks: Iterable[int], tier: str, readonly_blocks: int = 0) -> None:
        """Records blocks a request takes (its first `readonly_blocks` computed, read-only);
        checked once every free of the plan is known."""
        self._claims.append((tier, rid, tuple(blocks), readonly_blocks))

    def _check_claims(self) -> None:
        for tier, rid, blocks, readonly in self._claims:
            if tier == "GPU":
                self._gather_gpu_claim(rid, blocks, readonly)
            else:
                self._check_cpu_claim(rid, blocks)
        self._check_gpu_sharing()

    def _check_cpu_claim(self, rid: str, blocks: tuple[int, ...]) -> None:
        book, new = self.book, self.new_cpu
        num = book.num_cpu_blocks
        for b in blocks:
            if not 0 <= b < num:
                raise StepPlanError(f"CPU block {b} out of range [0, {num})", rid)
            if b in new:
                raise StepPlanError(f"CPU block {b} given to both {new[b]!r} and {rid!r}", rid)
            held = book.cpu_owner.get(b)
            if held is not None and held != rid and b not in self.freed_cpu and held not in self.released:
                # NOTE: ABORTED, not INVALID_ARGUMENT: the plan is well formed but the worker holds
                # state its sender did not account for (the states diverged).
                raise StepPlanError(f"CPU block {b} given to both {held!r} and {rid!r}", rid, code="ABORTED")
            new[b] = rid

    def _gather_gpu_claim(self, rid: str, blocks: tuple[int, ...], readonly: int) -> None:
        num, new = self.book.num_gpu_blocks, self.new_gpu
        for i, b in enumerate(blocks):
            if not 0 <= b < num:
                raise StepPlanError(f"GPU block {b} out of range [0, {num})", rid)
            claimers = new.setdefault(b, {})
            if rid in claimers:
                raise StepPlanError(f"GPU block {b} given to both {rid!r} and {rid!r}", rid)
            claimers[rid] = i < readonly
            if i < readonly:
                self.new_readonly.add(b)

    def _check_gpu_sharing(self) -> None:
        """A block with two holders after the plan must be read-only for every one of them."""
        book, released, freed = self.book, self.released, self.freed_gpu
        holders, readonly = book.gpu_holders, book.readonly
        for b, claimers in self.new_gpu.items():
            others = [
                h
                for h in holders.get(b, ())
                if h not in claimers and h not in released and (b, h) not in freed
            ]
            if not others and len(claimers) == 1:
                continue
            if all(claimers.values()) and (not others or b in readonly):
                continue
            writers = [r for r, ro in claimers.items() if not ro]
            rid = writers[0] if writers else next(iter(claimers))
            other = others[0] if others else next(r for r in claimers if r != rid)
            # A holder from earlier plans the sender did not free: the states diverged (ABORTED);
            # two claimers within this plan: the plan itself is wrong (INVALID_ARGUMENT).
            code = "ABORTED" if others else "INVALID_ARGUMENT"
            raise StepPlanError(f"GPU block {b} given to both {other!r} and {rid!r}", rid, code=code)

    def check(self, plan: StepPlan) -> None:
        for new in plan.new_requests:
            self._check_new(new)
        self._check_cached(plan)
        self._check_moves(plan)
        self._check_scheduled(plan)
        self._check_claims()

    def _check_new(self, new: NewRequestData) -> None:
        rid = new.request_id
        if rid in self.states:
            raise StepPlanError("sent as new twice in one plan", rid)
        if rid in self.book.entries and rid not in self.released:
            raise StepPlanError("sent as new but already known to the worker", rid, code="ABORTED")
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
        self._claim(rid, new.block_ids, "GPU", new.num_computed_tokens // self.book.block_size)
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
                kept = set(blocks)
                self.freed_gpu.update((b, rid) for b in state.gpu if b not in kept)
                state.gpu = list(blocks)
                self._claim(rid, blocks, "GPU", computed // self.book.block_size)
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
                self.freed_gpu.update((b, rid) for b in src)
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

