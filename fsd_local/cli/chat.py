"""`fsd-local chat`: a conversation over a loaded Engine, with settings that change live (slash commands).

The session keeps the messages; the engine keeps both KV caches and reuses their longest common prefix with
each new prompt, so turn n only evaluates turn n's new text. Output rules: standard output carries only the
assistant's words (pipes stay clean); banners, summaries and command feedback go to standard error.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import signal
import sys
import textwrap
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import click

from fsd_local.cli.options import say as _say_err
from fsd_local.cli.options import summary_line
from fsd_local.engine import CancelToken, Completion, Engine, Piece
from fsd_local.errors import ConfigError, FSDError
from fsd_local.llama.chat_template import ChatTemplate
from fsd_local.settings import FIELDS, OPTIONAL, Settings, field_type, spec

# command -> (Settings field, parser), from the settings that declare a chat command; a parser's ValueError
# becomes a usage hint
SETTERS = {chat: (f.name, field_type(f)) for f in FIELDS if (chat := spec(f).chat)}
ACTIONS = ("stats", "reset", "help", "quit")


def _setter_help(command: str) -> str:
    name, kind = SETTERS[command]
    s = spec(next(f for f in FIELDS if f.name == name))
    value = "X" if kind in (int, float) else command[0].upper()
    about = " | ".join(s.choices) if s.choices else s.help
    return textwrap.fill(about, 110, initial_indent=f"  /{command} {value}".ljust(18), subsequent_indent=" " * 18)


HELP = "\n".join(
    [
        "commands (settings apply from the next reply on, models stay loaded):",
        *(_setter_help(c) for c in SETTERS),
        "  /stats          settings, totals of this conversation, details of the last reply",
        "  /reset          start a new conversation (settings stay)",
        "  /help           this text",
        "  /quit           leave (Ctrl-D too); Ctrl-C stops the current reply only",
        "a command without a value shows the current one; start a message with // to send a literal leading /",
    ]
)
COLOURS = {"sd": "green", "fuzzy": "yellow", "forced": "magenta", "draft": "cyan", "target": None}
LEGEND = (
    "colours: "
    + click.style("green", fg="green")
    + " = draft token that passed the SD test, "
    + click.style("yellow", fg="yellow")
    + " = draft token rescued by tau (fuzzy), plain = the target's own"
)


# why a reply stopped, shown after the summary line
NOTES = {
    "context_full": "\nnote: the reply stopped because the context window is full; the next message leaves out "
    "the oldest turns (or raise --ctx)"
}


@dataclass
class Command:
    name: str
    arg: str | None = None


def parse_command(line: str) -> Command | None:
    """'/tau 0.2' -> Command('tau', '0.2'); None for an ordinary message (including '//...')."""
    line = line.strip()
    if not line.startswith("/") or line.startswith("//"):
        return None
    name, _, arg = line[1:].partition(" ")
    name = name.lower()
    if name not in SETTERS and name not in ACTIONS:
        raise ConfigError(f"unknown command /{name}; /help lists the commands")
    value = arg.strip() or None
    if value is not None and name in ACTIONS:
        raise ConfigError(f"/{name} takes no value")
    return Command(name, value)


@dataclass
class Totals:
    """Sums over the replies of one conversation."""

    replies: int = 0
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted_sd: int = 0
    accepted_fuzzy: int = 0
    seconds: float = 0.0
    prompt_evaluated: int = 0

    def add(self, st: dict) -> None:
        self.replies += 1
        for key in ("tokens", "rounds", "drafted", "accepted_sd", "accepted_fuzzy", "prompt_evaluated"):
            setattr(self, key, getattr(self, key) + st[key])
        self.seconds += st["seconds_total"]

    def line(self) -> str:
        accepted = self.accepted_sd + self.accepted_fuzzy
        return (
            f"conversation: {self.replies} replies, {self.tokens} tokens, "
            f"{self.tokens / self.seconds if self.seconds else 0:.1f} tok/s, "
            f"acceptance {accepted / self.drafted if self.drafted else 0:.0%}, "
            f"{self.tokens / self.rounds if self.rounds else 0:.2f} tokens/round, "
            f"fuzzy {self.accepted_fuzzy / accepted if accepted else 0:.0%}, "
            f"{self.prompt_evaluated} prompt tokens evaluated"
        )


@dataclass
class ChatSession:
    """One conversation with live settings. `reply` streams the engine's pieces and records the turn."""

    engine: Engine
    settings: Settings
    system: str | None = None
    messages: list = field(default_factory=list)
    totals: Totals = field(default_factory=Totals)
    last: Completion | None = None  # the last reply's Completion
    done: bool = False

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        # the caches are not cleared: the next prompt still shares the system prompt with them
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.totals = Totals()
        self.last = None

    def apply(self, cmd: Command) -> str:
        """Run a slash command; returns what to show. Bad values raise ConfigError and change nothing."""
        if cmd.name in SETTERS:
            key, parse = SETTERS[cmd.name]
            if cmd.arg is None:
                return f"{cmd.name} = {getattr(self.settings, key)}"
            try:
                value = None if key in OPTIONAL and cmd.arg.lower() in ("off", "none") else parse(cmd.arg)
            except ValueError:
                raise ConfigError(f"/{cmd.name} needs a number, e.g. /{cmd.name} 0.3; got {cmd.arg!r}") from None
            changed = self.settings.with_(**{key: value})  # validates
            changed.check_draft(self.engine.draft is not None)
            self.settings = changed
            return f"{cmd.name} = {getattr(self.settings, key)}"
        if cmd.name == "quit":
            self.done = True
            return "bye"
        if cmd.name == "reset":
            self.reset()
            return "new conversation"
        if cmd.name == "help":
            return HELP
        return self.stats_text()

    def stats_text(self) -> str:
        s = self.settings
        lines = [
            f"settings: {'tau ' + format(s.tau, 'g') if s.quality_budget is None else f'budget {s.quality_budget:g}'}, "
            f"mode {s.mode}, divergence {s.divergence}, temp {s.temperature:g}, "
            f"draft-max {s.draft_max}{' (adaptive)' if s.adaptive else ''}, max-tokens {s.max_tokens}",
            self.totals.line(),
        ]
        if self.last is not None:
            st = self.last.stats
            lines.append("last reply: " + summary_line(st, self.last.finish_reason))
            lines.append(
                "  acceptance by draft position: " + " ".join(f"{a:.0%}" for a in st["acceptance_by_position"])
            )
            if st["divergence_quantiles"]:
                lines.append(
                    f"  {s.divergence} quantiles: "
                    + " ".join(f"{q} {v:.3f}" for q, v in st["divergence_quantiles"].items())
                )
        return "\n".join(lines)

    def reply(self, text: str, cancel: CancelToken | None = None):
        """Yield the engine's pieces for the answer to `text`. The turn is recorded however the stream ends
        (finished, cancelled, or closed early): a partial answer stays in the conversation, so the next
        prompt still matches what the caches hold. A turn that produced nothing is dropped."""
        self.messages.append({"role": "user", "content": text})
        shown: list[str] = []
        completion: Completion | None = None
        try:
            with contextlib.closing(
                self.engine.chat_stream(self.messages, cancel=cancel, settings=self.settings)
            ) as stream:
                for piece in stream:
                    shown.append(piece.text)
                    completion = piece.completion or completion
                    yield piece
        finally:
            answer = completion.text if completion is not None else "".join(shown)
            if completion is None and not answer:
                self.messages.pop()
            else:
                self.messages.append({"role": "assistant", "content": answer})
            if completion is not None:
                self.last = completion
                self.totals.add(completion.stats)
                first = 1 if self.system else 0  # the engine left out the oldest turns: so does the session
                del self.messages[first : first + completion.dropped_messages]


class OriginPainter:
    """Colours released text by the origin of the token each character came from. It decodes the same token
    bytes as the engine's text stream, so released text is always a prefix of what it has decoded."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._bytes = token_bytes  # token id -> bytes (the target's piece)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending: deque[tuple[str, str]] = deque()  # (character, origin), decoded but not yet released

    def paint(self, piece: Piece) -> str:
        for token, origin in zip(piece.token_ids, piece.origins):
            self._pending.extend((ch, origin) for ch in self._utf8.decode(self._bytes(token)))
        if piece.completion is not None:
            self._pending.extend((ch, "target") for ch in self._utf8.decode(b"", final=True))
        out: list[str] = []
        run: list[str] = []
        run_origin = "target"  # set by the first character, before any run is styled
        for ch in piece.text:
            origin = self._pending.popleft()[1] if self._pending else "target"
            if origin != run_origin and run:
                out.append(self._style("".join(run), run_origin))
                run = []
            run_origin = origin
            run.append(ch)
        if run:
            out.append(self._style("".join(run), run_origin))
        return "".join(out)

    @staticmethod
    def _style(text: str, origin: str) -> str:
        colour = COLOURS.get(origin)
        return click.style(text, fg=colour) if colour else text


@contextlib.contextmanager
def interrupt_cancels(token: CancelToken):
    """While active, Ctrl-C (SIGINT) cancels the reply at the next round instead of raising, so the engine
    ends the stream normally: caches trimmed to the accepted text, a completion with statistics."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: token.cancel())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _read(interactive: bool) -> str | None:
    """The next line, or None at end of input (Ctrl-D)."""
    if not interactive:
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None
    while True:
        try:
            return input("you> ")  # unstyled: readline miscounts the width of escape sequences
        except EOFError:
            return None
        except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as in a shell
            click.echo()


def run_chat(
    session: ChatSession, *, color: bool = False, as_json: bool = False, interactive: bool | None = None
) -> None:
    """The terminal loop. Not a terminal on stdin: one message per line, plain text out."""
    say = _say_err
    interactive = sys.stdin.isatty() if interactive is None else interactive
    if ChatTemplate.from_model(session.engine.target).is_fallback:
        say("note: the target's GGUF has no chat template; using ChatML, which may not be what it was trained on")
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  line editing and history for input()
        s = session.settings
        say(
            f"chatting with tau {s.tau:g}, mode {s.mode}, divergence {s.divergence}. /help lists commands; "
            "Ctrl-C stops a reply, Ctrl-D leaves."
        )
        if color:
            say(LEGEND)
    while not session.done:
        line = _read(interactive)
        if line is None:
            break
        if not line.strip():
            continue
        try:
            cmd = parse_command(line)
            if cmd is not None:
                say(session.apply(cmd))
                continue
            stripped = line.lstrip()
            _answer(session, stripped[1:] if stripped.startswith("//") else line, color, as_json, say)
        except FSDError as exc:  # a bad command or a full context ends the turn, not the session
            say(f"error: {exc}")


def _answer(session: ChatSession, text: str, color: bool, as_json: bool, say) -> None:
    token = CancelToken()
    painter = OriginPainter(session.engine.target.piece) if color and not as_json else None
    with interrupt_cancels(token):
        for piece in session.reply(text, cancel=token):
            shown = painter.paint(piece) if painter else piece.text  # paint every piece to stay in step
            if shown and not as_json:
                click.echo(shown, nl=False)
    completion = session.last
    assert completion is not None  # the stream ran to its end: the engine's last piece carries the completion
    if not as_json:
        click.echo()
    if completion.dropped_messages:  # on standard error in every output mode
        say(
            f"note: the conversation outgrew the context ({session.engine.target.n_ctx} tokens): left out its "
            f"{completion.dropped_messages} oldest messages{' (the system message stays)' if session.system else ''}"
        )
    if as_json:
        keys = ("text", "finish_reason", "finish_detail", "dropped_messages", "stats")
        click.echo(json.dumps({k: v for k, v in completion.to_dict().items() if k in keys}))
        return
    notes = NOTES.get(completion.finish_detail or "", "")
    say(summary_line(completion.stats, completion.finish_reason, completion.finish_detail) + notes)
