"""Several generations of one Engine advanced together: each round one draft decode per draft position and one
target decode holding every sequence's input, each k from the batch policy; sequences join and leave between
rounds, each in its own KV sequence of both models (docs/design.md, "Several conversations at once")."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from fsd_local.chain import Chain
from fsd_local.drafting.batch_drafts import NOTHING, WAITING, draft_all
from fsd_local.drafting.batch_length import BatchPlan, BatchPrices, plan_from_costs, probe_pays
from fsd_local.drafting.cost_model import MODEL_DRAFT_COST_PRIOR, CostModel
from fsd_local.drafting.length import CATCH_UP_PRIOR, PENDING_MAX
from fsd_local.drafting.proposer import MODEL
from fsd_local.errors import ContextOverflowError, FSDError
from fsd_local.generation import Generation
from fsd_local.kernels.names import SPECULATIVE_MODES
from fsd_local.llama.model import Model
from fsd_local.llama.seq_batch import SeqBatch
from fsd_local.results import CancelToken, Piece
from fsd_local.round import (
    Proposal,
    Step,
    forced_run,
    judge,
    new_buffers,
    plain_emit,
    target_input,
)
from fsd_local.round import slots as n_slots
from fsd_local.settings import Settings

# tokens of a prompt (or of a draft model's catch-up) one round evaluates beside the others' rows while other
# calls are streaming: a joining call stalls them by one such decode at a time (docs/design.md, "Chunked prefill")
PREFILL_CHUNK = 64
# rounds a plan of no drafts holds while the same calls run and nothing is prefilled: no draft, no new acceptance
# evidence, so only the slowly moving prices could change it (and the search costs ~2% of a round of 4 on this host)
HOLD_PLAIN = 16
# drafts a probe tries (`Scheduler._probe_for`): as the one-call policy's probes of prompt lookup
PROBE_K = 2


def check_batchable(s: Settings, across: bool = False) -> None:
    """Refuse, in words, settings a batched round cannot run (yet): they run on an engine with parallel=1
    (`across`: the draft's vocabulary is not the target's)."""
    if across and s.mode in SPECULATIVE_MODES:
        raise FSDError(
            "a draft of another vocabulary drafts for one call at a time: use mode='ar' in a batch, or an Engine "
            "with parallel=1 (or a draft of the target's tokenizer)"
        )
    if s.mode == "draft-only":
        raise FSDError("draft-only generations run one at a time: use an Engine with parallel=1 for them")
    if s.mode in SPECULATIVE_MODES and s.drafter != "model":
        raise FSDError(
            f"drafter={s.drafter!r}: batched generations draft with the draft model only; use drafter='model' "
            "or an Engine with parallel=1"
        )


@dataclass(eq=False)
class Request:
    """A call waiting for a slot, and the queue its pieces (then a final piece, or an exception) go to."""

    prompt: Any
    s: Settings
    cancel: CancelToken | None
    dropped: int = 0
    out: queue.Queue = field(default_factory=queue.Queue)
    closed: CancelToken = field(default_factory=CancelToken)  # its reader stopped reading


@dataclass(eq=False)
class Slot:
    """An active call: its generation (in KV sequence g.seq_id), its acceptance estimate and adaptive k, and the
    engine's evidence under its settings (`shared`), which its outcomes feed for the calls after it."""

    req: Request
    g: Generation
    cm: CostModel | None
    shared: CostModel | None
    k: int
    clock: Any


class Scheduler:
    """The batch of an Engine made with parallel > 1: `submit` queues a call and returns its stream of pieces;
    one worker thread (started on demand, gone when idle) runs the rounds under the engine's lock."""

    def __init__(self, engine: Any, n_seq: int) -> None:
        self.eng = engine
        self.free = list(range(n_seq))
        self.waiting: deque[Request] = deque()
        self.active: list[Slot] = []
        self.batches = {m.role: SeqBatch(m) for m in engine._models()}
        self.prices = BatchPrices(engine.policy.length.verify)
        # the batch policy's latest choices (rounds where a call is `auto`), each with the calls it priced
        self.plans: deque[tuple[int, BatchPlan]] = deque(maxlen=256)
        self.rounds = 0
        self.peak = 0  # the most calls one round has advanced
        self.prefill_chunk = PREFILL_CHUNK
        self._plain: tuple[tuple[int, ...], int] | None = None  # (calls, round) of the last plan of no drafts
        self._probe: int | None = None  # the call (seq_id) drafting PROBE_K until it has drafted, though plans do not
        self.probes, self._turn = 0, 0  # probes started; whose turn to be weighed for the next
        self.k_counts: Counter[int] = Counter()  # the k each drafting-mode call drafted, a count per round it ran
        # (round, seq_id, role, tokens, calls that took a round beside it) of each chunk of a prompt or catch-up
        self.chunks: deque[tuple[int, int, str, int, int]] = deque(maxlen=4096)
        self._held = 0  # calls waiting to run alone (`alone`): no call joins the batch meanwhile
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ calls in, pieces out
    def submit(self, prompt, s: Settings, cancel: CancelToken | None, dropped: int = 0) -> Generator[Piece]:
        check_batchable(s, self.eng.across is not None)
        req = Request(prompt, s, cancel, dropped)
        with self._cond:
            self.waiting.append(req)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="fsd-local-batch", daemon=True)
                self._thread.start()
        return _pieces(req)

    def takes(self, s: Settings) -> bool:
        """Whether a batched round can run a call of these settings (else it runs `alone`)."""
        try:
            check_batchable(s, self.eng.across is not None)
        except FSDError:
            return False
        return True

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Inside, no batched call is active and none joins: a call the batch cannot run runs by itself in
        sequence 0, the other sequences' caches dropped; the batch resumes after."""
        with self._cond:
            self._held += 1
        try:
            while True:  # the active calls finish (none is admitted meanwhile)
                self.eng._lock.acquire()
                if not self.active:
                    break
                self.eng._lock.release()
                time.sleep(0.005)
            try:
                for m in self.eng._models():
                    for i in range(1, len(m.seqs)):
                        m.drop(i)
                yield
            finally:
                self.eng._lock.release()
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No round runs inside: calls submitted meanwhile wait, and join the batch together after."""
        with self.eng._lock:
            yield

    def join(self, timeout: float | None = None) -> None:
        """Wait until the worker is idle (every call answered)."""
        with self._cond:
            t = self._thread
        if t is not None:
            t.join(timeout)

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self.waiting and not self.active:
                    self._thread = None
                    return
            try:
                with self.eng._lock:
                    if self.eng._closed:  # close(): every call gets the engine's error in words
                        self._close()
                        continue
                    self._admit()
                    self._stop_cancelled()
                    if self.active:
                        self._round()
                if not self.active:  # calls wait while one runs alone: no spinning meanwhile
                    with self._cond:
                        self._cond.wait(0.01)
            except Exception as e:  # a failed batch decode: every call in it gets the error, the slots are freed
                for sl in list(self.active):
                    self._leave(sl)
                    sl.req.out.put(e)

    def _close(self) -> None:
        error = FSDError("this Engine was closed while the call ran (its models were freed); load a new one")
        with self._cond:
            waiting, self.waiting = list(self.waiting), deque()
        for req in [sl.req for sl in self.active] + waiting:
            req.out.put(error)
        self.active.clear()

    # ------------------------------------------------------------------ joining and leaving
    def _admit(self) -> None:
        while self.free and self.waiting and not self._held:
            with self._cond:
                req = self.waiting.popleft()
            if req.closed.is_set():  # its reader is gone
                continue
            try:
                self.active.append(self._join(req))
            except Exception as e:  # a bad prompt or a full context: this call's error, no other call's
                req.out.put(e)

    def _join(self, req: Request) -> Slot:
        eng, s = self.eng, req.s
        models = [eng.target, eng.draft] if s.mode in SPECULATIVE_MODES else [eng.target]
        seq = eng.prompt_tokens(req.prompt, models)
        sid = self._slot_for(seq)
        try:
            buffers = new_buffers(n_slots(s), eng.n_vocab, s.top_logprobs, s.logprobs)  # drafts and forced tokens
            chain = Chain(s, eng.n_vocab, eng.target).start(seq)
            budget = eng.policy.start(s)
            g = Generation(s, seq, models, eng.target, eng.n_vocab, budget, buffers, chain, req.dropped, seq_id=sid)
            for m in models:  # a batch reads every row on the host: no backend sampler picks (device_picks.py)
                m.sampler.use(None)
            shared = eng.policy.length.cost(MODEL) if g.speculative else None  # keyed by this call's settings
            cm = shared.fork() if shared is not None else None
            self._prefill(g, eager=not self.active)
        except BaseException:
            self.free.append(sid)
            raise
        return Slot(req, g, cm, shared, s.draft_max, g.stats.start_clock(eng.target, eng.draft))

    def _slot_for(self, seq: Sequence[int]) -> int:
        """The free sequence whose target cache shares the longest prefix with seq (a chat's next turn)."""
        cached = self.eng.target.seqs

        def common(i: int) -> int:
            n = 0
            for a, b in zip(cached[i], seq):
                if a != b:
                    break
                n += 1
            return n

        sid = max(self.free, key=common)
        self.free.remove(sid)
        return sid

    def _prefill(self, g: Generation, eager: bool) -> None:
        """Each model's sequence cut to its common prefix with seq (idle sequences' caches dropped when the shared
        cells would not hold this call); with `eager` (no other call streams) the target evaluates the rest now,
        else rounds do in chunks (`_round`); the draft model catches up when a round drafts for this call."""
        t0 = perf_counter()
        for m in g.models:
            need = len(g.seq) + g.s.max_tokens + g.s.draft_max
            if m._shared and sum(map(len, m.seqs)) + need > m.n_cells:
                for i in self.free:
                    m.drop(i)
            todo = g.seq[m.keep_common_prefix(g.seq, 0, g.seq_id) : -1]
            if m is not g.models[0]:
                continue
            g.stats.prompt_evaluated = len(todo) + 1
            b = self.batches[m.role]
            for i in range(0, len(todo), m.n_batch) if eager else ():
                b.add(g.seq_id, todo[i : i + m.n_batch], "none")
                b.decode()
            if eager:
                m.keep_state(g.seq_id)  # a recurrent state at the prompt's end: a regenerated reply goes back to it
        g.stats.prompt_seconds = perf_counter() - t0

    def chunk_for(self, m: Model) -> int:
        """Tokens of a prompt or a catch-up one decode of m evaluates: a chunk while other calls stream."""
        return min(self.prefill_chunk, m.n_batch // 2) if len(self.active) > 1 else m.n_batch // 2

    def _stop_cancelled(self) -> None:
        """Calls cancelled (their own token, a closed stream, Engine.cancel for all) or at their length end."""
        everyone = self.eng._cancel
        for sl in list(self.active):
            finish = sl.g.stop_reason(everyone, sl.req.cancel, sl.req.closed)
            if finish is not None:
                self._finish(sl, finish)
        if not self.eng._closed:
            everyone.clear()

    def _finish(self, sl: Slot, finish: str) -> None:
        g = sl.g
        self._leave(sl)
        tail = g.text.flush()
        self.eng.policy.save()
        sl.req.out.put(Piece(tail, [], [], g.completion(finish, self.eng.policy.plain_rate)))

    def _leave(self, sl: Slot) -> None:
        """The slot freed; its caches cut back to a prefix of its text (kept for a next turn that extends it)."""
        g = sl.g
        self.active.remove(sl)
        if g.seq_id == self._probe:
            self._probe = None
        for m in g.models:
            m.leave(g.seq, g.seq_id)
        self.free.append(g.seq_id)

    # ------------------------------------------------------------------ one round of every active call
    def _round(self) -> None:
        target, tb = self.eng.target, self.batches["target"]
        chunk = self.chunk_for(target)
        behind = [(sl, len(sl.g.seq) - len(target.seqs[sl.g.seq_id])) for sl in self.active]
        slots = [sl for sl, n in behind if n <= chunk + 1]
        for sl, n in behind:  # a call whose prompt is not evaluated yet gets a chunk of it instead of a round
            if n > chunk + 1:
                try:
                    tb.add(sl.g.seq_id, sl.g.seq[-n : chunk - n], "none")
                except ContextOverflowError:  # the shared cells are full: this call ends at its length
                    self._finish(sl, "length")
                    continue
                self.chunks.append((self.rounds, sl.g.seq_id, "target", chunk, len(slots)))
        prefill = tb.n
        t0 = perf_counter()
        proposals = draft_all(self, slots, self._ks(slots, prefill))
        for i, sl in enumerate(slots):  # ar verifies what a grammar forces as its proposal (round.forced_run)
            if not sl.g.speculative:
                proposals[i] = forced_run(sl.g.ctx) or NOTHING
        live = []
        for sl, p in zip(slots, proposals):
            if p is WAITING:
                continue
            part = target_input(sl.g.ctx, len(target.seqs[sl.g.seq_id]), p)
            target.checkpoint(sl.g.seq_id)  # a recurrent target without snapshots goes back here (else: nothing)
            try:
                tb.add(sl.g.seq_id, part.tokens, f"from:{part.first_row}")
            except ContextOverflowError:  # the shared cells are full: this call ends at its length
                self._finish(sl, "length")
                continue
            live.append((sl, p))
        n, rows_only = tb.n, tb.n == tb.n_rows  # a decode of verify rows alone prices them
        t = perf_counter()
        tb.decode()
        target.synchronize()
        seconds = perf_counter() - t
        if rows_only:
            self.prices.observe(self.prices.verify, n, seconds)
        self.rounds += 1
        self.peak = max(self.peak, len(live))
        for sl, p in live:
            g = sl.g
            rows = tb.rows(g.seq_id)
            if g.speculative or p.n:
                step = judge(g.ctx, p, rows, n, seconds, t0)
            else:
                step = plain_emit(g.ctx, rows, target.n_vocab, "target", n, seconds, t0)
            self._learn(sl, p, step)
            t = perf_counter()
            finish, piece = g.advance(step)
            sl.clock.tick(perf_counter() - t)
            if piece is not None:
                sl.req.out.put(piece)
            if finish is not None:
                self._finish(sl, finish)

    def _ks(self, slots: list[Slot], prefill: int) -> list[int]:
        """Each call's k: fixed or adaptive as its settings say; `auto` calls by the batch policy (the others' ks
        priced as given), plain where nothing is timed yet or the round also evaluates `prefill` tokens."""
        limits = [max(0, min(sl.g.s.draft_max, sl.g.room)) if sl.g.speculative else 0 for sl in slots]
        ks = [min(sl.k, lim) for sl, lim in zip(slots, limits)]
        auto = [sl.g.speculative and sl.g.s.draft_policy == "auto" for sl in slots]
        calls = tuple(sl.g.seq_id for sl in slots)
        held = self._plain is not None and self._plain[0] == calls and self.rounds - self._plain[1] < HOLD_PLAIN
        if not any(auto) or held or prefill or not self.prices.verify.measured:  # a first round times plain rows
            out = [0 if a else k for k, a in zip(ks, auto)]
        else:
            self._prime_draft_cost()
            given = [k > 0 and not a for k, a in zip(ks, auto)]  # their rows and draft decodes are paid anyway
            costs = [sl.cm if a or f else None for sl, a, f in zip(slots, auto, given)]
            start = [self._catch_up(sl) if a or f else 0.0 for sl, a, f in zip(slots, auto, given)]
            lims = [lim if a else k for lim, k, a in zip(limits, ks, auto)]
            plan = plan_from_costs(costs, lims, self.prices, start=start, fixed=given)
            self.plans.append((len(slots), plan))
            self._plain = (calls, self.rounds) if not any(p for p, a in zip(plan.ks, auto) if a) else None
            if self._plain is not None and self._probe is None:
                self._probe = self._probe_for(slots, auto, lims, costs, given)
            out = [p if a else k for p, k, a in zip(plan.ks, ks, auto)]
        probe = None if prefill else self._probe  # it drafts until it has drafted (a catch-up may take rounds)
        return [min(PROBE_K, lim) if sl.g.seq_id == probe else k for sl, k, lim in zip(slots, out, limits)]

    def _probe_for(self, slots, auto, limits, costs, given) -> int | None:
        """The call whose drafts are tried though the plan drafts none (each `auto` call in turn), where what they
        would tell is worth their price and its catch-up's (batch_length.probe_pays; docs/design.md)."""
        turn = [j for j, a in enumerate(auto) if a and limits[j]]
        if not turn:
            return None
        self._turn += 1
        j = turn[self._turn % len(turn)]
        sl, horizon = slots[j], len(slots) * slots[j].g.room  # its rounds left at one token a call
        if not probe_pays(costs, limits, self.prices, j, PROBE_K, horizon, self._catch_up(sl, False), fixed=given):
            return None
        self.probes += 1
        return sl.g.seq_id

    def _catch_up(self, sl: Slot, spread: bool = True) -> float:
        """What drafting at all costs a call this round: its draft model's catch-up on text it skipped, spread over
        the rounds it has left at two tokens a round (the catch-up serves every round after it) unless not `spread`."""
        assert self.eng.draft is not None
        behind = len(sl.g.seq) - len(self.eng.draft.seqs[sl.g.seq_id])
        if behind <= PENDING_MAX:
            return 0.0
        per_token = self.eng.policy.length.measured_catch_up_seconds or CATCH_UP_PRIOR * self.prices.draft.seconds(1)
        return behind * per_token / (max(1.0, sl.g.room / 2) if spread else 1.0)

    def _prime_draft_cost(self) -> None:
        """Before the batch has timed a draft decode: one row at what the engine measured a draft token costs."""
        if self.prices.draft.measured:
            return
        per_token = self.eng.policy.length.cost(MODEL).draft_seconds_per_token()
        if per_token <= 0.0:
            per_token = MODEL_DRAFT_COST_PRIOR * self.prices.verify.curve(1)[1]
        self.prices.draft.observe(1, per_token)

    def _learn(self, sl: Slot, p: Proposal, step: Step) -> None:
        """A drafting call's outcome: its acceptance estimate, and adaptive's +2 / -1."""
        made, accepted = p.drafter_counts(step.accepted)  # forced slots are no draft's evidence
        if not made:
            return
        if sl.g.seq_id == self._probe:  # the probe's evidence is in: plan again now
            self._probe, self._plain = None, None
        if sl.cm is not None and sl.shared is not None:  # its own estimate, and its settings' evidence
            sl.cm.observe_acceptance(made, accepted)
            sl.shared.observe_acceptance(made, accepted)
        s = sl.g.s
        if s.draft_policy == "adaptive":
            sl.k = min(sl.k + 2, s.draft_max) if accepted == made else max(sl.k - 1, s.draft_min)


def _pieces(req: Request) -> Generator[Piece]:
    """A call's pieces as the worker puts them; closing the stream frees its slot at the next round."""
    try:
        while True:
            item = req.out.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.completion is not None:
                return
    finally:
        req.closed.set()
