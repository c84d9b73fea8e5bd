"""The FSD engine: a loaded draft/target pair and its loop (`_run`): a `generation`, then `round` after round
(round.py; each observed by the policy, policy.py) and `Generation.advance` after each (docs/design.md)."""

from __future__ import annotations

import os
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from time import perf_counter
from typing import TYPE_CHECKING, Any

from fsd_local.batching import Scheduler
from fsd_local.chain import Chain
from fsd_local.conversation import fit_conversation, reply_room
from fsd_local.device_picks import plan as plan_picks
from fsd_local.drafting.across import Across
from fsd_local.drafting.calibration import CostStore
from fsd_local.drafting.follow import Following
from fsd_local.drafting.proposer import Proposer
from fsd_local.drafting.text_draft import TextDraft
from fsd_local.errors import ConfigError, FSDError
from fsd_local.generation import Generation
from fsd_local.kernels.names import SPECULATIVE_MODES
from fsd_local.kernels.warm import warm_up
from fsd_local.llama.kv_cache import check_rewindable
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.llama.vocab import CHOICES, Pairing, check_compatible
from fsd_local.policy import Policy
from fsd_local.prompting import chat_ids, checked_ids, loaded_context
from fsd_local.results import CancelToken, Completion, Piece, final_completion
from fsd_local.round import Proposal, Step, forced_run, new_buffers, plain_step, rewind_options, slots, verify
from fsd_local.settings import Settings

if TYPE_CHECKING:
    from fsd_local.llama.chat_template import ChatTemplate

__all__ = ["CancelToken", "Completion", "Engine", "Piece"]


def _options(model, n_ctx, n_threads, n_gpu_layers, parallel: int = 1, **rewind) -> ModelOptions:
    """`rewind`: how the role rewinds a recurrent state (ModelOptions.n_rs_seq, checkpoint; design.md)."""
    if isinstance(model, ModelOptions):
        return replace(model, **rewind) if parallel == 1 else replace(model, n_seq=parallel, **rewind)
    gpu = -1 if n_gpu_layers is None else n_gpu_layers
    return ModelOptions(str(model), n_ctx, n_threads, n_gpu_layers=gpu, n_seq=parallel, **rewind)


def larger_draft(draft: Model, target: Model) -> str | None:
    """The draft's and the target's parameters in words where the draft has more (None: it is the smaller)."""
    import llama_cpp as lc

    d, t = lc.llama_model_n_params(draft.model), lc.llama_model_n_params(target.model)
    return f"draft {draft.path} ({d:,} parameters) is larger than target {target.path} ({t:,})" if d > t else None


def _check_smaller(draft: Model, target: Model) -> None:
    """A draft across tokenizers is a smaller model: a larger one costs more than the target it drafts for."""
    larger = larger_draft(draft, target)
    if larger:
        raise ConfigError(
            f"{larger}: a draft must be the smaller model; swap --draft and --target, or pick a smaller draft "
            "(`fsd-local models --local`)"
        )


def _across(draft: Model, target: Model, want: str) -> tuple[Pairing, Following | None]:
    """The pair's path, and the draft's way to the target's tokens when their vocabularies differ."""
    p = check_compatible(draft, target, want)
    if p.vocab_map is None:
        return p, None
    _check_smaller(draft, target)
    if p.path == "map":
        return p, Across(draft, target, p.vocab_map)
    from fsd_local.llama.vocab_table import table_of

    return p, TextDraft(draft, target, table_of(target.path, target).end)


class Engine:
    """A loaded draft/target pair: `Engine(target=..., draft=..., tau=0.3)`, then `generate`, `chat`, `stream`.
    Calls are serialised by a lock; settings may change on every call."""

    target: Model  # set once loaded: a failed load raises before anyone can see the Engine
    draft: Model | None
    # what a server reads of whatever it serves (engine_like.py): a loaded Engine is always up
    state = "ok"
    reason: str | None = None
    last_start_seconds = 0.0
    model_process = None  # the models run in this process

    def __init__(
        self,
        target: str | os.PathLike | ModelOptions,
        draft: str | os.PathLike | ModelOptions | None = None,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_gpu_layers: int | None = -1,
        draft_n_gpu_layers: int | None = None,
        parallel: int = 1,
        across: str = "auto",
        settings: Settings | None = None,
        **setting_overrides: Any,
    ):
        # parallel > 1: that many calls at once, from different threads, advanced in one batch (batching.py);
        # n_ctx is then every call's tokens together (one unified KV cache a model). across: the path a draft of
        # another tokenizer takes (auto, map, text: llama/vocab.py choose_path)
        self.defaults = (settings or Settings()).with_(**setting_overrides)
        if across not in CHOICES:
            raise ConfigError(f"across must be one of {', '.join(CHOICES)} (a draft's path), not {across!r}")
        self.draft = None
        self.across: Following | None = None  # a draft of another vocabulary (drafting/across.py, text_draft.py)
        self.pairing: Pairing | None = None  # the path the pair takes (llama/vocab.py), None without a draft
        self.notes: list[str] = []  # what a caller should tell the user about the pair (one line each)
        # before loading: close() (also called when loading fails) takes the lock
        self._lock = threading.RLock()
        self._cancel = CancelToken()
        self._closed = False
        try:
            # a verify batch is rolled back within itself (snapshots: its drafts and one; an architecture without
            # them, to a checkpoint taken before it); the draft decodes one token a call, so it goes back to where
            # its drafting began (a checkpoint)
            rs, draft_rs = rewind_options(self.defaults)
            self.target = Model(_options(target, n_ctx, n_threads, n_gpu_layers, parallel, **rs), "target")
            if draft is not None:
                draft_gpu = n_gpu_layers if draft_n_gpu_layers is None else draft_n_gpu_layers
                self.draft = Model(_options(draft, n_ctx, n_threads, draft_gpu, parallel, **draft_rs), "draft")
                self.pairing, self.across = _across(self.draft, self.target, across)
                larger = larger_draft(self.draft, self.target) if self.across is None else None
                if larger:  # one tokenizer: it runs, exactly, but every round costs more than plain decoding
                    self.notes.append(f"{larger}: it costs more than it saves; swap --draft and --target?")
            check_rewindable(self.defaults.rewound(self.target, self.draft), self.defaults.mode)
        except BaseException:
            self.close()
            raise
        # speculative modes work on the shared vocabulary (sizes may differ by up to 128 padding entries); a draft
        # of another vocabulary proposes the target's tokens, so they work on the target's
        one = self.draft is not None and self.across is None
        self.n_vocab = min(self.target.n_vocab, self.draft.n_vocab) if one and self.draft else self.target.n_vocab
        # the policy state (draft length, measured costs kept on disk per model and machine, budgets' gains)
        self._policy = Policy(CostStore.for_models(self.target, self.draft), redecode=self.target.redecodes)
        self._proposer = Proposer(self.draft, self.n_vocab, self._policy.length, self.across)
        self._buffers_key: tuple | None = None  # the round buffers (owned here, lent to each call) fit these settings
        self.parallel = parallel  # calls at once (a server's slots)
        self._batch = Scheduler(self, parallel) if parallel > 1 else None
        warm_up()  # JIT/cache-load the kernels now, not inside the first generation's timed span

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
        from the first piece until the stream ends or is closed: iterate it in one thread, to the end or close().
        With parallel > 1 calls from several threads run batched, each stream read in its own thread."""
        s = self._settings(settings, overrides)
        if self._batch is not None:
            return self._batch.submit(prompt, s, cancel) if self._batch.takes(s) else self._alone(prompt, s, cancel)
        return self._run(prompt, s, cancel)

    def _settings(self, settings: Settings | None, overrides: Mapping[str, Any]) -> Settings:
        s = settings or self.defaults
        if overrides:
            s = s.with_(**overrides)
        s.check_draft(self.draft is not None)
        s.check_vocab(self.n_vocab)
        check_rewindable(s.rewound(self.target, self.draft), s.mode)
        if self.across is not None and s.mode == "draft-only":
            raise ConfigError(
                "draft-only decodes the draft's own tokens, and this draft's vocabulary is not the target's; "
                "use a speculative mode (sd, fsd, ...) or a draft of the target's tokenizer"
            )
        return s

    def chat_template(self) -> ChatTemplate:
        """The target's chat template (read once per loaded model)."""
        from fsd_local.llama.chat_template import ChatTemplate

        self._check_open()
        return ChatTemplate.of(self.target)

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation ready for the reply, as prompting.py says for every EngineLike."""
        self._check_open()
        return chat_ids(self, messages)

    def cached_tokens(self) -> list[int]:
        """What the target's KV cache holds."""
        return list(self.target.tokens)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        cancel: CancelToken | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Completion:
        """Reply to a list of {'role', 'content'} messages; earlier turns stay in both KV caches. When the conversation
        and room for the reply do not fit the context, the oldest turns are left out (conversation.py):
        `dropped_messages` says how many."""
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
        n_ctx = loaded_context(self)
        room = reply_room(s.max_tokens, n_ctx)
        tokens, dropped = fit_conversation(self.chat_prompt, messages, n_ctx, room, self.cached_tokens())
        if self._batch is not None and self._batch.takes(s):
            return self._batch.submit(tokens, s, cancel, dropped)
        return (
            self._alone(tokens, s, cancel, dropped)
            if self._batch is not None
            else self._run(tokens, s, cancel, dropped)
        )

    @property
    def batch(self) -> Scheduler | None:
        """The batch of calls at once (parallel > 1; batching.py), else None."""
        return self._batch

    @property
    def policy(self) -> Policy:
        """The policy state this engine keeps across calls (policy.py): draft length, measured costs, budgets."""
        return self._policy

    def policy_state(self) -> dict:
        """A copy of what this engine learned about acceptance under each setting (the `auto` policy's evidence,
        the quality budget's settled gains); `set_policy_state` puts it back. Measured costs are not part of it."""
        return self._policy.evidence()

    def measure_costs(self, k_max: int) -> float:
        """Time every target batch size 1..k_max + 1 and the draft model's token and catch-up not measured yet
        (drafting/calibration.py): what a benchmark does before its timed runs, so that every configuration is
        priced from the same complete curve. Generations never wait for this; returns the seconds it took."""
        with self._lock:
            self._check_open()
            self.reset()
            token = self.target.bos if self.target.bos >= 0 else 0
            seconds = self._policy.measure(self.target, self.draft, k_max + 1, token)
            self.reset()
            return seconds

    def set_policy_state(self, state: dict | None) -> None:
        """Put back a `policy_state` copy, or with None forget all of it, as a freshly loaded engine (the measured
        costs of the machine stay): what a benchmark gives each configuration."""
        with self._lock:
            self._policy.restore(state)

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
        """The prompt as token ids, checked once for every caller (the loop, the server) as prompting.py says;
        `models`: only these read it (their contexts bound it)."""
        self._check_open()
        return checked_ids(self, prompt, min(m.n_ctx for m in models) if models else None)

    def _alone(self, prompt, s: Settings, cancel, dropped: int = 0) -> Generator[Piece, None, None]:
        """A call the batch cannot run (draft-only, prompt lookup, ...): by itself, between the batch's calls."""
        assert self._batch is not None
        with self._batch.alone():
            yield from self._run(prompt, s, cancel, dropped)

    def _run(self, prompt, s: Settings, cancel, dropped: int = 0) -> Generator[Piece, None, None]:
        with self._lock:
            with self._generation(prompt, s, cancel, dropped) as g:
                clock = g.stats.start_clock(self.target, self.draft)
                finish = None
                while finish is None and (finish := g.stop_reason(self._cancel, cancel)) is None:
                    step = self.round(g)  # drafted and verified, or a plain step; the policy learns from it
                    t = perf_counter()
                    finish, piece = g.advance(step)  # the text, the caches, the statistics, the stream
                    clock.tick(perf_counter() - t)
                    if piece is not None:
                        yield piece
            tail = g.text.flush()  # before the completion takes the text
            yield Piece(tail, [], [], g.completion(finish, self._policy.plain_rate))

    def round(self, g: Generation) -> Step:
        """One round of `g`, its speculative mode's drafts verified in one target decode (else a plain step),
        and the policy's observation of it."""
        ctx = g.ctx
        if g.speculative:
            proposal: Proposal | None = self._proposer.propose(ctx)
        else:  # ar verifies what a grammar forces as a batch of its own; draft-only decides with the draft
            proposal = forced_run(ctx) if g.s.mode == "ar" else None
        if proposal is not None:
            step = verify(self.target, ctx, proposal)
        else:
            step = plain_step(g.models[0], ctx, "target" if g.s.mode == "ar" else "draft")
        t = perf_counter()
        if g.speculative:
            self._proposer.observe(ctx, step)  # a plain step's target row, for the draft model's catch-up
        self._policy.observe(step)  # the draft length and the measured costs
        g.stats.add_phase("policy", perf_counter() - t)
        return step

    def generation(
        self, prompt: str | Sequence[int], *, settings: Settings | None = None, cancel=None, **overrides: Any
    ) -> AbstractContextManager[Generation]:
        """A generation of `prompt`, its caches filled, under the engine's lock: drive it with `round` and
        `Generation.advance`. Leaving it, however, cuts every cache back to a prefix of the text."""
        return self._generation(prompt, self._settings(settings, overrides), cancel)

    @contextmanager
    def _generation(self, prompt, s: Settings, cancel, dropped: int = 0) -> Iterator[Generation]:
        with self._lock:
            g = self._start(prompt, s, dropped)
            try:
                self._prefill(g, cancel, cut=dropped > 0 and s.context_shift)
                yield g
            finally:
                for m in g.models if not self._closed else ():  # close() from this thread while a stream was paused
                    m.leave(g.seq)  # a prefix of seq, whatever happened; a recurrent state kept for a next turn
                if self.across is not None and not self._closed:
                    self.across.draft.forget_unknown_tail()  # its own ids: the follower trims it to the text
            self._policy.save()

    def _start(self, prompt, s: Settings, dropped: int) -> Generation:
        """A call's state, its buffers sized for its settings (reused across calls while they fit)."""
        self._check_open()
        self._cancel.clear()
        if s.needs_draft:  # the draft model runs (prompt lookup alone needs none)
            assert self.draft is not None, "stream() checked that this mode has its draft"
            models = [self.target, self.draft] if s.mode in SPECULATIVE_MODES else [self.draft]
            if self.across is not None:  # its cache holds its own ids of the text: the follower keeps it
                models = [self.target]
        else:
            models = [self.target]
        seq = self.prompt_tokens(prompt, models)
        key = (slots(s), s.top_logprobs, s.logprobs)
        if self._buffers_key != key:
            self._buffers = new_buffers(slots(s), self.n_vocab, s.top_logprobs, s.logprobs)
            self._buffers_key = key
        chain = Chain(s, self.n_vocab, self.target).start(seq)  # penalties, bias, grammar
        budget = self._policy.start(s)
        g = Generation(s, seq, models, self.target, self.n_vocab, budget, self._buffers, chain, dropped)
        plan_picks(g.ctx, self.target, self.draft)  # which picks llama.cpp's backend samplers make (device_picks.py)
        if g.speculative:
            self._proposer.start(g.ctx, target_rows=not self.target.sampler.active)
        return g

    def _prefill(self, g: Generation, cancel, cut: bool = False) -> None:
        """Make each model's cache hold seq[:-1], reusing the common prefix (and with `cut`, after a chat dropped
        its oldest turns under context_shift, what followed them); the last token goes into the first round."""
        t0 = perf_counter()
        for m in g.models:
            if cut:
                m.reuse_after_cut(g.seq)
            todo = g.seq[m.keep_common_prefix(g.seq) : -1]
            if m is self.draft and g.speculative and not self._policy.draft_follows_prompt():
                continue  # plain steps win from the start: the draft catches up if a round drafts (drafting/length.py)
            t = perf_counter()
            for i in range(0, len(todo), m.n_batch):
                if self._cancel.is_set() or (cancel is not None and cancel.is_set()):
                    break
                m.decode(todo[i : i + m.n_batch], logits="none")
            m.keep_state()  # a recurrent state at the prompt's end: a regenerated reply goes back to it
            if m is self.draft and g.speculative:  # a batch it runs anyway prices its tokens
                m.synchronize()
                self._policy.observe_prompt(len(todo), perf_counter() - t)
            if m is g.models[0]:
                g.stats.prompt_evaluated = len(todo) + 1
        if self.across is not None and g.speculative and g.s.needs_draft:
            self._follow_prompt(self.across, g.seq[:-1])
        g.stats.prompt_seconds = perf_counter() - t0

    def _follow_prompt(self, a: Following, text: Sequence[int]) -> None:
        """The draft's own tokens of the prompt's text; the batch it decodes prices its tokens for `auto` as a
        draft of the target's vocabulary prices them from its prompt."""
        d = a.draft
        before = list(d.tokens)
        t = perf_counter()
        a.sync(text)
        d.synchronize()
        seconds = perf_counter() - t
        common = next((i for i, (x, y) in enumerate(zip(before, d.tokens)) if x != y), min(len(before), len(d.tokens)))
        if len(d.tokens) - common > 1:
            self._policy.observe_prompt(len(d.tokens) - common, seconds)
