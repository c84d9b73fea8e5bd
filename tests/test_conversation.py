"""Conversations that outgrow the context: the oldest turns are dropped (never the system message, never the
newest message), both KV caches keep what follows them, and a reply cut short by a full context says so.
Real llama.cpp models throughout (the tiny GGUFs; the SmolLM2 demo pair for the chat command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import llama_cpp as lc
import pytest

from fsd_local import ContextOverflowError, Engine, Settings
from fsd_local.cli.chat import ChatSession
from fsd_local.conversation import _common, fit_conversation, reply_room

SYSTEM = {"role": "system", "content": "answer briefly"}


def turns(n: int, words: int = 12) -> list[dict]:
    """n user/assistant turns, then a newest user message."""
    msgs = []
    for i in range(n):
        msgs.append({"role": "user", "content": f"question {i}: " + "tell me about the fox " * (words // 5)})
        msgs.append({"role": "assistant", "content": f"answer {i}: " + "the fox walks at night " * (words // 5)})
    return msgs + [{"role": "user", "content": "and the owl?"}]


@pytest.fixture(scope="module")
def small_ctx_engine(tiny_pair):
    d, t = tiny_pair
    with Engine(target=t, draft=d, n_ctx=256, n_threads=1) as eng:
        yield eng


def test_fit_drops_whole_oldest_turns_down_to_the_low_water_mark(tiny_engine):
    msgs = [SYSTEM, *turns(8)]
    full = tiny_engine.chat_prompt(msgs)
    n_ctx, room = len(full) - 40, 32
    tokens, dropped = fit_conversation(tiny_engine.chat_prompt, msgs, n_ctx, room)
    kept = [msgs[0], *msgs[1 + dropped :]]
    assert dropped > 0 and dropped % 2 == 0  # user + assistant, dropped together
    assert kept[1]["role"] == "user" and kept[-1] == msgs[-1]
    assert tokens == tiny_engine.chat_prompt(kept)
    # a quarter of the context is left free besides the room, so the next turns fit as they are; one turn
    # fewer dropped would not have left it
    assert len(tokens) + room <= n_ctx - n_ctx // 4
    assert len(tiny_engine.chat_prompt([msgs[0], *msgs[1 + dropped - 2 :]])) + room > n_ctx - n_ctx // 4


def test_fit_without_a_system_message_and_when_nothing_needs_dropping(tiny_engine):
    msgs = turns(3)
    full = tiny_engine.chat_prompt(msgs)
    assert fit_conversation(tiny_engine.chat_prompt, msgs, len(full) + 10, 10) == (full, 0)
    tokens, dropped = fit_conversation(tiny_engine.chat_prompt, msgs, len(full), 10)
    assert dropped in (2, 4, 6) and tokens == tiny_engine.chat_prompt(msgs[dropped:])
    assert msgs[dropped]["role"] == "user"


def test_a_caller_sending_the_whole_history_keeps_the_cut_the_cache_holds(tiny_engine):
    """An API client re-sends everything: the next call keeps the previous call's cut while it fits, so the
    caches' prefix stays valid (no new drop, no re-evaluation) until the context is full again."""
    msgs = [SYSTEM, *turns(8)]
    n_ctx = len(tiny_engine.chat_prompt(msgs)) - 40
    tokens, dropped = fit_conversation(tiny_engine.chat_prompt, msgs, n_ctx, 16)
    kept = [msgs[0], *msgs[1 + dropped :]]

    def longer_by(words: int) -> list[dict]:
        reply = {"role": "assistant", "content": "the owl hoots " * words}
        return msgs + [reply, {"role": "user", "content": "ok"}]

    # a next turn that still fits after the same cut, but not under the low-water mark any more
    words = next(
        w
        for w in range(1, 200)
        if len(tiny_engine.chat_prompt(kept[:1] + longer_by(w)[1 + dropped :])) + 16 > n_ctx - n_ctx // 4
    )
    longer = longer_by(words)
    assert len(tiny_engine.chat_prompt(kept[:1] + longer[1 + dropped :])) + 16 <= n_ctx
    again, dropped_again = fit_conversation(tiny_engine.chat_prompt, longer, n_ctx, 16, cached=tokens)
    assert dropped_again == dropped and again[: len(tokens) - 8] == tokens[: len(tokens) - 8]
    # without the cache's hint the low-water mark applies afresh, which cuts elsewhere
    _, fresh = fit_conversation(tiny_engine.chat_prompt, longer, n_ctx, 16)
    assert fresh > dropped


def test_fit_keeps_the_newest_message_even_without_room_and_refuses_what_cannot_fit(tiny_engine):
    msgs = [SYSTEM, *turns(2)]
    alone = tiny_engine.chat_prompt([SYSTEM, msgs[-1]])
    tokens, dropped = fit_conversation(tiny_engine.chat_prompt, msgs, len(alone) + 1, 64)
    assert (tokens, dropped) == (alone, 4)  # everything else dropped; the reply gets the one token left
    with pytest.raises(ContextOverflowError, match="the system message and the newest message take"):
        fit_conversation(tiny_engine.chat_prompt, msgs, len(alone) - 1, 1)


def test_reply_room_is_max_tokens_up_to_half_the_context():
    assert (reply_room(64, 512), reply_room(1000, 512), reply_room(0, 512)) == (64, 256, 1)


def converse(eng, turns_: int, **settings) -> list:
    """A conversation of short questions as a chat app keeps it (dropped messages removed); the completions."""
    msgs, out = [SYSTEM], []
    for i in range(turns_):
        msgs.append({"role": "user", "content": f"message {i}: where does the fox go at night?"})
        c = eng.chat(msgs, max_tokens=24, **settings)
        del msgs[1 : 1 + c.dropped_messages]
        msgs.append({"role": "assistant", "content": c.text})
        out.append(c)
        seq = eng.chat_prompt(msgs[:-1]) + c.token_ids  # both caches hold a prefix of the accepted text
        for m in (eng.target, eng.draft):
            assert m.tokens == seq[: len(m.tokens)] and len(m.tokens) >= len(seq) - 2
    return out


def evaluated(replies, dropped: bool) -> list[int]:
    return [c.stats["prompt_evaluated"] for c in replies[2:] if bool(c.dropped_messages) == dropped]


# The tiny models reply in random bytes, which the next prompt renders as U+FFFD: each turn evaluates its new
# message and about as many tokens again for the reply re-tokenised. The real pair's check is below.
def test_chat_drops_turns_and_keeps_reusing_both_caches(tiny_engine):
    """A conversation three times longer than the context keeps going; each drop leaves a quarter of the
    context free, so the turns after it only evaluate their new text (exact: the drop turn re-evaluates)."""
    tiny_engine.reset()
    replies = converse(tiny_engine, 20, tau=0.3)
    assert sum(c.dropped_messages > 0 for c in replies) >= 4
    assert all(c.prompt_tokens + 24 <= tiny_engine.target.n_ctx for c in replies)
    kept = [c for c in replies[2:] if not c.dropped_messages]
    assert all(c.stats["prompt_evaluated"] * 2 < c.stats["prompt_tokens"] for c in kept)
    # the turn that drops evaluates what it keeps after the system message again
    assert min(evaluated(replies, True)) > max(evaluated(replies, False)) + 30


def test_context_shift_cuts_the_dropped_turns_out_of_both_caches(tiny_engine):
    tiny_engine.reset()
    replies = converse(tiny_engine, 20, tau=0.3, context_shift=True)
    drops = [c for c in replies if c.dropped_messages]
    assert len(drops) >= 4
    # the turns that drop evaluate no more than the others: what follows the dropped turns was shifted
    assert max(evaluated(replies, True)) < max(evaluated(replies, False)) + 10
    for m in (tiny_engine.target, tiny_engine.draft):  # llama.cpp's positions agree with ours
        assert lc.llama_memory_seq_pos_max(m.mem, 0) == len(m.tokens) - 1


def test_speculation_stays_exact_on_shifted_caches(small_ctx_engine):
    """After a context shift, greedy sd emits exactly what ar emits from the same (shifted) caches."""
    eng = small_ctx_engine
    n = next(n for n in range(1, 20) if len(eng.chat_prompt([SYSTEM, *turns(n, 5)])) > eng.target.n_ctx - 64)
    msgs = [SYSTEM, *turns(n, 5)]
    full = eng.chat_prompt(msgs)
    out = {}
    for mode in ("ar", "sd"):
        eng.reset()
        for m in (eng.target, eng.draft):
            m.decode(full[:-1], "none")
        out[mode] = eng.chat(msgs, max_tokens=64, mode=mode, context_shift=True, logprobs=True)
        assert out[mode].dropped_messages > 0
        assert out[mode].stats["prompt_evaluated"] * 2 < out[mode].stats["prompt_tokens"]
    assert out["sd"].token_ids == out["ar"].token_ids
    assert out["sd"].logprobs == pytest.approx(out["ar"].logprobs, abs=1e-4)


def test_a_reply_stopped_by_a_full_context_says_so(small_ctx_engine):
    eng = small_ctx_engine
    eng.reset()
    c = eng.chat([{"role": "user", "content": "hi"}], max_tokens=1000, ignore_eos=True)
    assert (c.finish_reason, c.finish_detail) == ("length", "context_full")
    assert c.prompt_tokens + len(c.token_ids) == eng.target.n_ctx + 1  # the last token is never stored
    c = eng.chat([{"role": "user", "content": "hi"}], max_tokens=5, ignore_eos=True)
    assert (c.finish_reason, c.finish_detail) == ("length", "max_tokens")
    assert c.to_dict()["finish_detail"] == "max_tokens"


def test_chat_session_forgets_the_dropped_turns(small_ctx_engine):
    small_ctx_engine.reset()
    session = ChatSession(small_ctx_engine, Settings(max_tokens=24), system="answer briefly")
    dropped = 0
    for i in range(8):
        for _ in session.reply(f"turn {i}: what does the owl say to the fox?"):
            pass
        dropped += session.last.dropped_messages
        assert session.messages[0]["role"] == "system"
        assert session.messages[1]["role"] == "user" and session.messages[-1]["role"] == "assistant"
        assert session.messages[-2]["content"] == f"turn {i}: what does the owl say to the fox?"
    assert dropped > 0 and len(session.messages) == 1 + 2 * 8 - dropped


def chat_cli(args, lines, timeout=1800):
    return subprocess.run(
        [sys.executable, "-m", "fsd_local.cli", "chat", "--threads", "1", *args],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ},
    )


@pytest.mark.parametrize("as_json", [True, False])
def test_chat_through_a_pipe_says_when_it_drops_turns(tiny_pair, as_json):
    draft, target = tiny_pair
    lines = [f"message {i}: where does the fox go at night?" for i in range(12)]
    args = ["--target", target, "--draft", draft, "--ctx", "256", "--max-tokens", "24", "--system", "be brief"]
    run = chat_cli([*args, *(["--json"] if as_json else [])], lines, timeout=300)
    assert run.returncode == 0, run.stderr
    notices = [ln for ln in run.stderr.splitlines() if ln.startswith("note: the conversation outgrew the context")]
    assert len(notices) >= 2 and all("(the system message stays)" in n for n in notices)
    assert "error:" not in run.stderr and "Traceback" not in run.stderr
    if as_json:
        replies = [json.loads(line) for line in run.stdout.splitlines()]
        assert len(replies) == 12 and sum(r["dropped_messages"] > 0 for r in replies) == len(notices)
        assert {r["finish_detail"] for r in replies} <= {"max_tokens", None}
    else:
        assert len([ln for ln in run.stderr.splitlines() if ln.startswith("[")]) == 12  # a summary per reply


MESSAGES = [
    "Hi! Who are you?",
    "What is the capital of France?",
    "Tell me about Paris in two sentences.",
    "What is a good name for a cat?",
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "What is 2 + 2?",
    "Name three fruits.",
    "How do birds fly?",
    "What is Python?",
    "Give me a tip for sleeping well.",
    "What is the largest ocean?",
    "Describe a sunset.",
    "What do bees make?",
    "Tell me a short joke.",
    "What is the opposite of hot?",
    "How many days are in a week?",
    "What colour is grass?",
    "Say something kind.",
    "Thanks, goodbye!",
]


@pytest.mark.real
def test_twenty_messages_through_a_pipe_on_the_demo_pair_with_a_small_context():
    """The issue's check: --ctx 512 --max-tokens 64, 20 messages: every one answered, rc 0, the drop notice."""
    run = chat_cli(["--ctx", "512", "--max-tokens", "64", "--json", "--tau", "0.2", "--seed", "1"], MESSAGES)
    assert run.returncode == 0, run.stderr
    replies = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(replies) == 20 and all(r["stats"]["tokens"] > 0 for r in replies)
    assert "error:" not in run.stderr and "Traceback" not in run.stderr
    notices = [ln for ln in run.stderr.splitlines() if ln.startswith("note: the conversation outgrew the context")]
    assert notices and sum(r["dropped_messages"] > 0 for r in replies) == len(notices)
    # after each drop the caches are reused again: the turns that do not drop evaluate only their new text
    dropped = [i for i, r in enumerate(replies) if r["dropped_messages"]]
    after = [replies[i + 1] for i in dropped if i + 1 < len(replies) and not replies[i + 1]["dropped_messages"]]
    assert after
    for r in after:
        assert r["stats"]["prompt_evaluated"] * 3 < r["stats"]["prompt_tokens"], r["stats"]
    print(run.stderr)
    print(
        "\n".join(
            f"{r['dropped_messages']} dropped, {r['stats']['prompt_evaluated']}/{r['stats']['prompt_tokens']}"
            for r in replies
        )
    )


def test_a_sampled_replys_own_tokens_are_reused_by_the_next_turn(tiny_engine):
    """Sampling often writes a reply in tokens the tokenizer would split otherwise (here: byte tokens where the
    vocabulary has the character). Rendered back into the next turn and tokenized again, the reply would differ
    from the caches from its first such token on; the prompt keeps the cached tokens instead, so the next turn
    evaluates its new text only, and the text of the prompt is unchanged."""
    eng = tiny_engine
    eng.reset()
    msgs = [{"role": "user", "content": "tell me about the fox"}]
    ascii_only = {t: float("-inf") for t in range(3 + 128, 3 + 256)}  # byte tokens above 0x7f: whole UTF-8 only
    for seed in range(20):  # a seed whose reply is not the tokenizer's own split of its text
        eng.reset()
        first = eng.chat(msgs, max_tokens=24, temperature=1.5, seed=seed, mode="sd", logit_bias=ascii_only)
        if first.text and eng.tokenize(first.text, add_special=False) != first.token_ids:
            break
    else:
        pytest.skip("no sampled reply with a split of its own in 20 seeds")
    nxt = [*msgs, {"role": "assistant", "content": first.text}, {"role": "user", "content": "and the owl?"}]
    canonical = eng.target.tokenize(eng.chat_template().render(nxt, add_generation_prompt=True), add_special=True)
    spliced = eng.chat_prompt(nxt)
    assert spliced != canonical and eng.detokenize(spliced) == eng.detokenize(canonical)
    second = eng.chat(nxt, max_tokens=4, mode="sd")
    # only what follows the reply is evaluated: the reply's own tokens (all but the last, never fed) are cached
    assert second.stats["prompt_evaluated"] <= len(spliced) - first.stats["prompt_tokens"] - len(first.token_ids) + 2
    assert _common(spliced, canonical) < first.stats["prompt_tokens"] + len(first.token_ids) - 1
