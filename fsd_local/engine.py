"""The FSD loop: prompt -> tokens -> draft -> verify -> accept -> trim -> stream.

One round (FSD.md): the draft proposes up to k tokens, the target scores [last accepted, d_1..d_k] in ONE
decode, `accept_round` keeps the longest acceptable prefix and picks one more token, then both KV caches are
cut back to their longest common prefix with the accepted text. Every model's cache is always a prefix of
the accepted text, so the next round, the next call and the next chat turn only evaluate what is new.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Generator, Mapping, Sequence
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np

from fsd_local.chain import Chain
from fsd_local.conversation import fit_conversation, reply_room, splice_cached
from fsd_local.drafting.proposer import Proposer
from fsd_local.errors import FSDError
from fsd_local.kernels.accept import (
    AR,
    BY_FUZZY,
    DRAFT_ONLY,
    MODES,
    accept_round,
    emit_one,
    rule_of,
    sampling_of,
    warm_up,
)
from fsd_local.kernels.budget import Budgets, stop_at, threshold
from fsd_local.kernels.names import SPECULATIVE_MODES
from fsd_local.kernels.penalties import warm_up as warm_chain
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.llama.vocab import check_compatible
from fsd_local.results import (
    CancelToken,
    Completion,
    Emitted,
    Piece,
    check_prompt_ids,
    final_completion,
    length_detail,
)
from fsd_local.settings import Settings
from fsd_local.stats import Stats
from fsd_local.stream import TextStream

__all__ = ["CancelToken", "Completion", "Engine", "Piece"]

ORIGINS = {0: "target", 1: "sd", 2: "fuzzy"}  # why each emitted token is there


def _options(model, n_ctx, n_threads, n_gpu_layers) -> ModelOptions:
    if isinstance(model, ModelOptions):
        return model
    return ModelOptions(
        path=str(model), n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=-1 if n_gpu_layers is None else n_gpu_layers
    )


class Engine:
    """A loaded draft/target pair. Calls are serialised by a lock; settings may change on every call.

    with Engine(target="big.gguf", draft="small.gguf", tau=0.3) as eng:
        out = eng.generate("Once upon a time", max_tokens=64)
        print(out.text, out.stats["acceptance_rate"])
    """

    target: Model  # set once loaded: a failed load raises before anyone can see the Engine
    draft: Model | None

    def __init__(
        self,
        target: str | os.PathLike | ModelOptions,
        draft: str | os.PathLike | ModelOptions | None = None,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_gpu_layers: int | None = -1,
        draft_n_gpu_layers: int | None = None,
        settings: Settings | None = None,
        **setting_overrides: Any,
    ):
        self.defaults = (settings or Settings()).with_(**setting_overrides)
        self.draft = None
        # before loading: close() (also called when loading fails) takes the lock
        self._lock = threading.RLock()
        self._cancel = CancelToken()
        self._closed = False
        try:
            self.target = Model(_options(target, n_ctx, n_threads, n_gpu_layers), "target")
            if draft is not None:
                self.draft = Model(
                    _options(
                        draft, n_ctx, n_threads, n_gpu_layers if draft_n_gpu_layers is None else draft_n_gpu_layers
                    ),
                    "draft",
                )
                check_compatible(self.draft, self.target)
        except BaseException:
            self.close()
            raise
        # speculative modes work on the shared vocabulary (sizes may differ by up to 128 padding entries)
        self.n_vocab = min(self.target.n_vocab, self.draft.n_vocab) if self.draft else self.target.n_vocab
        self._proposer = Proposer(self.draft, self.n_vocab, self.defaults.draft_max)
        self._lengths = self._proposer.lengths
        self._budgets = Budgets()  # the thresholds a quality budget settled on, for the next reply
        warm_up()  # JIT/cache-load the kernels now, not inside the first generation's timed span
        warm_chain()

    # ------------------------------------------------------------------ public API
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        self._check_open()
        return self.target.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._check_open()
        return self.target.detokenize(tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token renders to (special tokens: none), as the text of a reply is made of them."""
        self._check_open()
        return self.target.piece(token)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        cancel: CancelToken | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Completion:
        """Run to completion; returns text, token ids, finish reason and statistics. `settings` replaces the
        engine's defaults for this call; keyword overrides change single fields of whichever applies."""
        return final_completion(self.stream(prompt, cancel=cancel, settings=settings, **overrides))

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        cancel: CancelToken | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Generator[Piece, None, None]:
        """Yield pieces as tokens are accepted; the last piece carries `.completion`. The engine's lock is held
        from the first piece until the stream ends or is closed: iterate it in one thread, to the end or close()."""
        return self._run(prompt, self._settings(settings, overrides), cancel)

    def _settings(self, settings: Settings | None, overrides: Mapping[str, Any]) -> Settings:
        s = settings or self.defaults
        if overrides:
            s = s.with_(**overrides)
        s.check_draft(self.draft is not None)
        s.check_vocab(self.n_vocab)
        return s

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation rendered with the target's chat template, ready for the reply."""
        from fsd_local.llama.chat_template import ChatTemplate

        self._check_open()
        if getattr(self, "_template", None) is None:
            self._template = ChatTemplate.from_model(self.target)
        text = self._template.render(messages, add_generation_prompt=True)
        bos = self._template.bos_token
        # the template may write BOS itself; never add a second one
        ids = self.target.tokenize(text, add_special=not (bos and text.startswith(bos)))
        return splice_cached(ids, list(self.target.tokens), self.target.piece)  # a sampled reply's own split

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        cancel: CancelToken | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Completion:
        """Reply to a list of {'role', 'content'} messages. Earlier turns stay in both KV caches, so the next
        call only evaluates what is new. When the conversation and room for the reply (max_tokens, at most half
        the context) do not fit, the oldest turns are left out (never the system message, never the newest
        message; conversation.py): `dropped_messages` says how many."""
        return final_completion(self.chat_stream(messages, cancel=cancel, settings=settings, **overrides))

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        cancel: CancelToken | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Generator[Piece, None, None]:
        s = self._settings(settings, overrides)
        n_ctx = min(m.n_ctx for m in self._models())
        room = reply_room(s.max_tokens, n_ctx)
        tokens, dropped = fit_conversation(self.chat_prompt, messages, n_ctx, room, self.target.tokens)
        return self._run(tokens, s, cancel, dropped)

    def policy_state(self) -> dict:
        """A copy of what this engine learned about acceptance under each setting (the `auto` policy's evidence,
        the quality budget's settled gains); `set_policy_state` puts it back. Measured costs are not part of it."""
        return {"lengths": self._lengths.evidence(), "budgets": self._budgets.copy()}

    def set_policy_state(self, state: dict | None) -> None:
        """Put back a `policy_state` copy, or with None forget all of it, as a freshly loaded engine (the measured
        costs of the machine stay): what a benchmark gives each configuration."""
        with self._lock:
            self._lengths.restore(None if state is None else state["lengths"])
            self._budgets = Budgets() if state is None else state["budgets"].copy()

    def cancel(self) -> None:
        """Stop the generation that is running now (if any) at its next round."""
        self._cancel.set()

    def reset(self) -> None:
        """Forget both KV caches (the next call re-evaluates its whole prompt)."""
        with self._lock:
            for m in self._models():
                m.clear()

    def close(self) -> None:
        """Free both models now. A generation running in another thread is cancelled and waited for; calling
        close() again does nothing; any later call raises FSDError."""
        self._cancel.set()
        with self._lock:
            self._closed = True
            for m in (self.draft, getattr(self, "target", None)):  # no target yet if loading it failed
                if m is not None:
                    m.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise FSDError("this Engine is closed (its models were freed); load a new one")

    # ------------------------------------------------------------------ the loop
    def _models(self):
        return [m for m in (self.target, self.draft) if m is not None]

    def prompt_tokens(self, prompt: str | Sequence[int], models: Sequence[Model] | None = None) -> list[int]:
        """The prompt as token ids, checked once for every caller (the loop, the server): ids inside the
        vocabulary, not empty, and short enough for the context of every model that will read it."""
        self._check_open()
        tokens = self.target.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        n_ctx = min(m.n_ctx for m in (models or self._models()))
        return check_prompt_ids(tokens, self.n_vocab, n_ctx)

    def _run(self, prompt, s: Settings, cancel, dropped: int = 0) -> Generator[Piece, None, None]:
        mode = MODES.index(s.mode)
        speculative = s.mode in SPECULATIVE_MODES
        rule, sampling = rule_of(s), sampling_of(s)  # the kernels' view of the settings, once per call
        with self._lock:
            self._check_open()
            self._cancel.clear()
            if s.needs_draft:  # the draft model runs (prompt lookup alone needs none)
                assert self.draft is not None, "stream() checked that this mode has its draft"
                models = [self.target, self.draft] if speculative else [self.draft]
            else:
                models = [self.target]
            seq = self.prompt_tokens(prompt, models)
            chain = self._proposer.chain = Chain(s, seq, self.n_vocab, self.target)  # penalties, bias, grammar
            n_ctx = min(m.n_ctx for m in models)
            self._proposer.reserve(s.draft_max, s.top_logprobs)
            self._proposer.start(s)
            rng = np.random.default_rng(s.seed)
            stats = Stats(prompt_tokens=len(seq))
            stats.budget = self._budgets.start(s, self._proposer.drafts.tokens.shape[0])
            text = TextStream(s.stop)
            ends = partial(self._ends_reply, text, s.ignore_eos)  # which draft would end the reply (budget's cap)
            reply = Emitted()  # the tokens shown so far, with their origins and log-probabilities
            finish = None
            try:
                t0 = perf_counter()
                for m in models:
                    evaluated = self._prefill(m, seq, cancel, cut=dropped > 0 and s.context_shift)
                    if m is models[0]:
                        stats.prompt_evaluated = evaluated
                if speculative and s.draft_policy == "auto":  # the target's cost per batch size, measured once
                    self._proposer.calibrate(self.target, seq, s.draft_max + 1)
                    if s.drafter != "ngram":
                        self._proposer.calibrate_draft(seq)
                stats.prompt_seconds = perf_counter() - t0
                t_start = perf_counter()
                lengths = self._lengths
                lengths.start(s)
                while finish is None:
                    if self._cancel.is_set() or (cancel is not None and cancel.is_set()):
                        finish = "cancelled"
                        break
                    remaining = s.max_tokens - stats.tokens
                    if remaining <= 0 or len(seq) > n_ctx:
                        finish = "length"
                        break
                    if speculative:
                        n_drafts, source, k, t_draft = self._proposer.propose(
                            seq, min(remaining - 1, n_ctx - len(seq)), s, _threshold(rule, stats.budget), rng, stats
                        )
                        t_target = stats.seconds_target
                        step = self._verify(seq, n_drafts, rule, sampling, rng, stats, ends)
                        new = step.tokens
                        lengths.observe(source, n_drafts, len(new) - 1, t_draft, stats.seconds_target - t_target)
                        stats.record_k(k)
                    else:
                        step = self._plain_step(models[0], seq, sampling, rng, stats, mode)
                        new = step.tokens
                    start = len(seq)
                    seq.extend(new)
                    for m in models:  # trim: each cache keeps its longest common prefix with the accepted text
                        m.keep_common_prefix(seq, start - 1)
                    shown = []
                    for t in new:
                        if not s.ignore_eos and self.target.is_eog(t):
                            finish = "stop"
                            break
                        shown.append(t)
                    step = step.head(len(shown))
                    reply.extend(step)
                    released = text.push(b"".join(self.target.piece(t) for t in shown))
                    if text.stopped or chain.finished:  # a stop string, or the grammar is complete
                        finish = "stop"
                    stats.seconds_total = perf_counter() - t_start
                    if released or shown:
                        yield step.piece(released, s.logprobs, s.top_logprobs > 0)
                stats.seconds_total = perf_counter() - t_start
            finally:
                for m in models if not self._closed else ():  # close() from this thread while a stream was paused
                    m.forget_unknown_tail()  # whatever happened (Ctrl-C, errors), leave each cache a prefix of seq
                    m.keep_common_prefix(seq)
            tail = text.flush()
            completion = Completion(
                text=text.text,
                token_ids=reply.tokens,
                finish_reason=finish,
                stats=stats.to_dict(),
                settings=s.to_dict(),
                prompt_tokens=stats.prompt_tokens,
                origins=reply.origins,
                finish_detail=length_detail(finish, stats.tokens, s.max_tokens),
                dropped_messages=dropped,
            )
            completion.logprobs, completion.top_logprobs = reply.logprob_fields(s.logprobs, s.top_logprobs > 0)
            if mode == DRAFT_ONLY:
                completion.stats["target_logprob_mean"] = completion.stats["loss_per_token"] = None
            plain = self._lengths.plain_tokens_per_second_est
            completion.stats["plain_tokens_per_second_est"] = plain
            completion.stats["speedup_vs_plain_est"] = completion.stats["tokens_per_second"] / plain if plain else None
            yield Piece(tail, [], [], completion)

    def _prefill(self, m: Model, seq: list[int], cancel, cut: bool = False) -> int:
        """Make the cache hold seq[:-1], reusing the common prefix (and with `cut`, after a chat dropped its oldest
        turns under context_shift, what followed them); the last token goes into the first round."""
        if cut:
            m.reuse_after_cut(seq)
        keep = m.keep_common_prefix(seq)
        todo = seq[keep:-1]
        for i in range(0, len(todo), m.n_batch):
            if self._cancel.is_set() or (cancel is not None and cancel.is_set()):
                break
            m.decode(todo[i : i + m.n_batch], logits="none")
        return len(todo) + 1

    def _ends_reply(self, text: TextStream, ignore_eos: bool, drafts: list[int]) -> int | None:
        """The first of these drafts that would end the reply if emitted: end of generation or a stop string."""
        eog = None if ignore_eos else next((j for j, t in enumerate(drafts) if self.target.is_eog(t)), None)
        stop = text.stop_index([self.target.piece(t) for t in drafts[:eog]]) if text.stop else None
        return stop if stop is not None else eog

    def _verify(self, seq, n_drafts, rule, sampling, rng, stats, ends):
        """Score [last accepted, d_1..d_n] in one target decode, then apply the acceptance rule. ends(drafts): the
        first draft that would end the reply (the quality budget's cap counts the tokens up to there)."""
        tgt = self.target
        pending = seq[len(tgt.tokens) :]
        drafts = self._proposer.drafts.tokens[:n_drafts].tolist()
        if stats.budget.bound > 0.0 and sampling.temperature <= 0.0:  # where a greedy round is decided whole
            stop_at(stats.budget, ends(drafts))
        t = perf_counter()
        tgt.decode(pending + drafts, f"from:{len(pending) - 1}")
        tgt.synchronize()
        dt = perf_counter() - t
        stats.seconds_target += dt
        stats.record_verify(len(pending) + n_drafts, dt)
        p = tgt.logits(n_drafts + 1)
        chain = self._proposer.chain
        chain.target_rows(p, n_drafts)  # the same processing as the draft's rows had
        if not n_drafts and self._proposer.keeps_rows:  # a plain step: the draft model may be scored on it later
            self._proposer.keep_target_row(len(seq), p[0])
        us = rng.random(n_drafts + 1) if sampling.temperature > 0 else np.zeros(n_drafts + 1)
        out = self._proposer.out
        drafts_in, budget = self._proposer.drafts, stats.budget
        accepted, nxt = accept_round(p, drafts_in, n_drafts, self.n_vocab, rule, sampling, us, out, budget)
        chain.settle(accepted, nxt)
        stats.record_round(n_drafts, out.reason, out.divergence, out.logprob, accepted + 1, budget.loss)
        reasons = out.reason[:accepted].tolist()
        origins = [ORIGINS[r] for r in reasons] + ["target"]
        # a rescued token's divergence and log-probability gap (the target's top token's log-prob minus its own)
        rescues: list[tuple[float, float] | None] = [
            (float(out.divergence[i]), float(p[i, : self.n_vocab].max() - p[i, drafts[i]])) if r == BY_FUZZY else None
            for i, r in enumerate(reasons)
        ] + [None]
        return Emitted(drafts[:accepted] + [int(nxt)], origins, *_logprobs(out, accepted + 1), rescues, n_drafts)

    def _plain_step(self, m: Model, seq, sampling, rng, stats, mode):
        """The baselines: one token from one model (target for ar, draft for draft-only)."""
        todo = seq[len(m.tokens) :]
        t = perf_counter()
        m.decode(todo, "last")
        m.synchronize()
        dt = perf_counter() - t
        if mode == AR:
            stats.seconds_target += dt
            stats.record_verify(len(todo), dt)
            self._lengths.observe(None, 0, 0, 0.0, dt)
        else:
            stats.seconds_draft += dt
        u = rng.random() if sampling.temperature > 0 else 0.0
        rows, out = m.logits(1), self._proposer.out
        self._proposer.chain.target_rows(rows, 0)  # the same processing as every target row
        tok, lp = emit_one(rows[0], m.n_vocab, sampling, u, self._proposer.drafts.stats[0], out)
        self._proposer.chain.settle(0, tok)
        stats.rounds += 1
        stats.tokens += 1
        stats.target_calls += mode == AR
        if mode == AR:
            stats.logprob_sum += lp
            stats.logprob_count += 1
        return Emitted([int(tok)], ["draft" if mode == DRAFT_ONLY else "target"], *_logprobs(out, 1), [None])


def _threshold(rule, budget) -> float:
    """The rule's threshold this round: tau, or the one a quality budget set (B = 0: exactly sd)."""
    if budget.bound < 0.0:
        return rule.tau
    return threshold(budget) if budget.bound > 0.0 else 0.0


def _logprobs(out, n: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The log-probabilities of a round's n emitted tokens and their top alternatives, from the kernel's RoundOut."""
    lps = out.logprob[:n].tolist()
    ids, top = out.top_ids[:n].tolist(), out.top_logprob[:n].tolist()
    return lps, [[(i, v) for i, v in zip(ri, rv) if i >= 0] for ri, rv in zip(ids, top)]
