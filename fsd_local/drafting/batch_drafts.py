"""The draft half of a batched round (batching.py): every drafting call's proposal from one draft decode per draft
position for all of them, as drafting/proposer.py drafts for one call; a long catch-up goes in chunks. `sch` is
batching.Scheduler and each slot its Slot (a layer above: named, not imported)."""

from __future__ import annotations

from time import perf_counter
from typing import Any

from fsd_local.drafting.proposer import MODEL, DraftPicks
from fsd_local.errors import ContextOverflowError
from fsd_local.llama.model import Model
from fsd_local.round import Proposal, force, forced_flags

NOTHING = Proposal(0, None, 0, 0.0)  # a call that drafts nothing this round: its plain step rides along
WAITING = Proposal(0, None, 0, 0.0)  # a call whose draft cache catches up in chunks: no target row this round


def draft_all(sch: Any, slots: list[Any], ks: list[int]) -> list[Proposal]:
    """Every drafting call's proposal: its grammar's forced tokens first, then one draft decode per position for
    all calls (the first also evaluating what each draft cache lacks), each call picking from its own row and its
    grammar's run after each draft decoded with it next, as drafting/proposer.py does for one call."""
    proposals = [NOTHING] * len(slots)
    d: Model | None = sch.eng.draft
    if d is None:
        return proposals
    db, picks = sch.batches["draft"], {}
    t0 = perf_counter()
    for i, (sl, k) in enumerate(zip(slots, ks)):
        if not sl.g.speculative:
            continue
        ctx, sid = sl.g.ctx, sl.g.seq_id
        behind, chunk = ctx.seq[len(d.seqs[sid]) :], sch.chunk_for(d)
        if k and len(behind) > chunk + 1:  # a long catch-up goes in chunks; the call waits and drafts after it,
            try:  # as it would alone (a round of k = 0 instead would change what a lossy rule accepts)
                db.add(sid, behind[:chunk], "none")
                sch.chunks.append((sch.rounds, sid, "draft", chunk, len(slots)))
                proposals[i] = WAITING
                continue
            except ContextOverflowError:  # no room in the draft's cells: this call drafts nothing this round
                k = 0
        forced = force(ctx, 0, 0)  # no drafter proposes what the grammar forces
        n = len(forced)
        proposals[i] = Proposal(n, None, 0, 0.0, forced=forced_flags(ctx, n)) if n else NOTHING
        k = max(0, min(k, ctx.room - n))
        try:
            if k:
                db.add(sid, [*behind, *forced], "last")
                picks[i] = DraftPicks(ctx, sch.eng.n_vocab, k, n)
        except ContextOverflowError:  # no room in the draft's cells: this call drafts nothing this round
            k = 0
        sch.k_counts[k] += 1
    going, first = dict(picks), True
    while going or db.n:
        rows_only = db.n == db.n_rows  # one token a sequence: a price for the batch policy
        m, t = db.n_rows, perf_counter()
        db.decode()
        d.synchronize()
        if rows_only:
            sch.prices.observe(sch.prices.draft, m, perf_counter() - t)
        for i in going if first else ():  # drafts decode one a call: a recurrent state goes back here (else: nothing)
            if going[i].k > 1:
                d.checkpoint(slots[i].g.seq_id)
        going, first = {i: pk for i, pk in going.items() if _next_draft(sch, slots[i], pk)}, False
    share = (perf_counter() - t0) / len(picks) if picks else 0.0
    for i, pk in picks.items():
        ctx = slots[i].g.ctx
        proposals[i] = Proposal(pk.n, MODEL if pk.made else None, ks[i], share, forced=forced_flags(ctx, pk.n))
    return proposals


def _next_draft(sch: Any, sl: Any, pk: DraftPicks) -> bool:
    """One call's draft from its row of the last draft decode, and the grammar's run after it (DraftPicks.ends);
    whether it drafts on (its draft and run then queued for the next decode)."""
    ctx, sid, db = sl.g.ctx, sl.g.seq_id, sch.batches["draft"]
    tok = pk.pick(db.rows(sid)[-1])
    if tok is None or pk.ends(ctx):
        return False
    try:
        db.add(sid, [tok, *pk.run], "last")
    except ContextOverflowError:  # no room for the next draft: this call's drafts end here
        return False
    return True
