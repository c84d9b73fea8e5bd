"""fsd-local chat: conversation state over real llama.cpp (tiny GGUFs), live settings, Ctrl-C, pipes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import click
import pytest

from fsd_local import CancelToken, ConfigError, ContextOverflowError, Engine, Settings
from fsd_local.cli.chat import ChatSession, Command, OriginPainter, interrupt_cancels, parse_command
from fsd_local.engine import Piece

LONG = (
    "please tell me a story about a fox who walks through the forest at night, meets an owl, "
    "and asks it the way home; the owl answers with a riddle and the fox has to think hard. "
) * 2


@pytest.fixture
def session(tiny_engine):
    tiny_engine.reset()
    return ChatSession(tiny_engine, Settings(max_tokens=12, draft_policy="fixed", draft_max=4))


def say(session, text, cancel=None):
    for _ in session.reply(text, cancel=cancel):
        pass
    return session.last


def command(session, line):
    return session.apply(parse_command(line))


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize(
    "line, expected",
    [
        ("/tau 0.2", Command("tau", "0.2")),
        ("  /MODE   sd ", Command("mode", "sd")),
        ("/divergence kl", Command("divergence", "kl")),
        ("/temp", Command("temp", None)),
        ("/quit", Command("quit")),
        ("hello /tau 0.2", None),
        ("//tau is a word", None),
    ],
)
def test_parse_command(line, expected):
    assert parse_command(line) == expected


@pytest.mark.parametrize(
    "line, message",
    [
        ("/tua 0.2", r"unknown command /tua; /help lists the commands"),
        ("/stats now", r"/stats takes no value"),
        ("/", r"unknown command /;"),
    ],
)
def test_parse_command_errors(line, message):
    with pytest.raises(ConfigError, match=message):
        parse_command(line)


# ------------------------------------------------------------------ turns and caches
def test_second_turn_does_not_reevaluate_the_first(session, tiny_engine):
    first = say(session, LONG)
    assert first.stats["prompt_evaluated"] == first.stats["prompt_tokens"] > 150  # fresh caches
    second = say(session, "and then?")
    st = second.stats
    # everything of turn 1's prompt came from the caches; only the new text was evaluated
    assert st["prompt_evaluated"] <= st["prompt_tokens"] - first.stats["prompt_tokens"]
    assert st["prompt_evaluated"] * 4 < st["prompt_tokens"]
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    assert session.messages[1]["content"] == first.text
    # reuse changes nothing: a fresh evaluation of the same conversation gives the same reply
    tiny_engine.reset()
    fresh = tiny_engine.generate(tiny_engine.chat_prompt(session.messages[:3]), **session.settings.to_dict())
    assert fresh.stats["prompt_evaluated"] == st["prompt_tokens"]
    assert fresh.token_ids == second.token_ids
    assert session.totals.replies == 2 and session.totals.tokens == first.stats["tokens"] + st["tokens"]


def test_slash_commands_change_the_next_reply(session):
    assert command(session, "/divergence tv") == "divergence = tv"
    assert command(session, "/tau 1") == "tau = 1.0"
    loose = say(session, "hello there")
    # total variation is at most 1: with tau 1 every draft token is accepted, most by fuzzy rescue
    assert loose.settings["tau"] == 1.0 and loose.settings["divergence"] == "tv"
    assert loose.stats["acceptance_rate"] == 1.0 and loose.stats["accepted_fuzzy"] > 0
    assert command(session, "/mode sd") == "mode = sd"
    strict = say(session, "hello again")
    assert strict.settings["mode"] == "sd"
    assert strict.stats["accepted_fuzzy"] == 0 and strict.stats["acceptance_rate"] < 1.0
    assert command(session, "/temp 0.7") == "temp = 0.7"
    assert say(session, "once more").settings["temperature"] == 0.7
    assert command(session, "/tau") == "tau = 1.0"


@pytest.mark.parametrize(
    "line, message",
    [
        ("/tau abc", r"/tau needs a number, e.g. /tau 0.3; got 'abc'"),
        ("/tau -1", r"tau=-1.0 must be >= 0"),
        ("/tau nan", r"tau=nan must be a finite number"),
        ("/mode nope", r"mode='nope' is not a mode; choose one of fsd, fsd-paper, sd, ar, draft-only"),
        ("/divergence jsd", r"divergence='jsd' is not a divergence; choose one of js, kl"),
        ("/temp -0.5", r"temperature=-0.5 must be >= 0"),
    ],
)
def test_bad_values_are_refused_and_change_nothing(session, line, message):
    before = session.settings
    with pytest.raises(ConfigError, match=message):
        command(session, line)
    assert session.settings == before


def test_speculative_mode_needs_a_draft(tiny_pair):
    with Engine(target=tiny_pair[1], n_ctx=256, n_threads=1, draft_policy="fixed", draft_max=4) as eng:
        s = ChatSession(eng, Settings(mode="ar", max_tokens=4))
        with pytest.raises(ConfigError, match="mode 'sd' needs a draft model"):
            command(s, "/mode sd")
        assert say(s, "hi").settings["mode"] == "ar"


def test_stats_help_reset_quit(session):
    say(session, "hello there")
    stats = command(session, "/stats")
    assert "settings: tau 0, mode fsd, divergence js, temp 0, draft-max 4, max-tokens 12" in stats
    assert "conversation: 1 replies, 12 tokens" in stats
    assert "last reply: [length] 12 tokens" in stats and "acceptance by draft position:" in stats
    help_text = command(session, "/help")
    for name in ("/tau", "/mode", "/divergence", "/temp", "/stats", "/reset", "/help", "/quit"):
        assert name in help_text
    session.system = "be brief"
    assert command(session, "/reset") == "new conversation"
    assert session.messages == [{"role": "system", "content": "be brief"}] and session.totals.replies == 0
    assert session.last is None and not session.done
    command(session, "/quit")
    assert session.done


# ------------------------------------------------------------------ stopping a reply
def test_cancel_keeps_the_partial_reply_and_the_session(session):
    session.settings = session.settings.with_(max_tokens=200)
    token = CancelToken()
    shown = []
    for piece in session.reply(LONG, cancel=token):
        shown.append(piece.text)
        token.cancel()
    cut = session.last
    assert cut.finish_reason == "cancelled" and 0 < cut.stats["tokens"] < 200
    assert session.messages[-1] == {"role": "assistant", "content": cut.text} and cut.text == "".join(shown)
    session.settings = session.settings.with_(max_tokens=8)
    after = say(session, "go on")
    assert after.finish_reason == "length"
    assert after.stats["prompt_evaluated"] * 4 < after.stats["prompt_tokens"]


def test_ctrl_c_cancels_the_reply_instead_of_raising(session):
    session.settings = session.settings.with_(max_tokens=200)
    token = CancelToken()
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs as a background job
    with interrupt_cancels(token):
        for piece in session.reply("tell me more", cancel=token):
            if piece.token_ids and not token.is_set():
                os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # the handler it found is back
    assert session.last.finish_reason == "cancelled" and session.last.stats["tokens"] < 200


def test_closing_the_stream_early_records_the_turn(session, tiny_engine):
    stream = session.reply(LONG)
    first = next(p for p in stream if p.text)
    stream.close()
    assert session.messages[-1]["role"] == "assistant"
    assert session.messages[-1]["content"].startswith(first.text)
    # both caches were trimmed to a prefix of the accepted text: the next turn reuses them
    after = say(session, "go on")
    assert after.stats["prompt_evaluated"] * 4 < after.stats["prompt_tokens"]


def test_a_turn_that_does_not_fit_is_dropped(session):
    say(session, "hello")
    before = list(session.messages)
    with pytest.raises(ContextOverflowError):
        say(session, LONG * 3)  # the tiny engine's context holds 512 tokens
    assert session.messages == before


# ------------------------------------------------------------------ colours
def test_painter_colours_characters_by_the_token_they_came_from():
    pieces = {1: b"ab", 2: b"\xc3", 3: b"\xa9", 4: b"z"}
    painter = OriginPainter(pieces.__getitem__)
    green_ab = painter.paint(Piece("ab", [1, 2], ["sd", "fuzzy"]))
    assert green_ab == click.style("ab", fg="green")
    # "é" is completed by token 3 (a target token); "z" was rescued by tau
    rest = painter.paint(Piece("éz", [3, 4], ["target", "fuzzy"]))
    assert rest == "é" + click.style("z", fg="yellow")


def test_painted_reply_is_the_reply(session, tiny_engine):
    command(session, "/divergence tv")
    command(session, "/tau 1")
    painter = OriginPainter(tiny_engine.target.piece)
    painted = "".join(painter.paint(p) for p in session.reply("hello there"))
    assert click.unstyle(painted) == session.last.text
    assert "\x1b[32m" in painted or "\x1b[33m" in painted  # some draft tokens are shown coloured


# ------------------------------------------------------------------ the command through a pipe
def chat_cli(args, lines, env=None):
    return subprocess.run(
        [sys.executable, "-m", "fsd_local.cli", "chat", "--ctx", "512", "--threads", "1", "--max-tokens", "10", *args],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_chat_through_a_pipe_keeps_the_conversation(tiny_pair):
    draft, target = tiny_pair
    run = chat_cli(
        ["--target", target, "--draft", draft, "--json"],
        [LONG, "/tau 0.3", "/tau nope", "", "and then?", LONG * 3, "/quit", "never sent"],
    )
    assert run.returncode == 0, run.stderr
    replies = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(replies) == 2
    first, second = replies[0]["stats"], replies[1]["stats"]
    assert first["prompt_evaluated"] == first["prompt_tokens"]
    assert second["prompt_evaluated"] <= second["prompt_tokens"] - first["prompt_tokens"]
    assert replies[0]["stats"]["tokens"] == 10 and replies[1]["finish_reason"] == "length"
    assert "tau = 0.3" in run.stderr and "error: /tau needs a number, e.g. /tau 0.3; got 'nope'" in run.stderr
    # too long for the context even alone: reported, session goes on
    assert "error: the newest message alone takes" in run.stderr
    assert "Traceback" not in run.stderr


def test_chat_through_a_pipe_prints_plain_text_and_summaries(tiny_pair):
    draft, target = tiny_pair
    run = chat_cli(["--target", target, "--draft", draft, "--color", "--tau", "0.2"], ["hello", "again"])
    assert run.returncode == 0, run.stderr
    assert "\x1b[" not in run.stdout and len(run.stdout.splitlines()) >= 2
    assert "no chat template; using ChatML" in run.stderr  # the tiny models have none
    # chat samples with a fresh seed each session: a reply may draw end-of-generation before its 10 tokens
    summaries = [ln for ln in run.stderr.splitlines() if re.match(r"\[(length|stop)\] \d+ tokens", ln)]
    assert len(summaries) == 2, run.stderr
    assert all("tok/s, acceptance" in s and "tokens/round, fuzzy" in s for s in summaries)
