"""Tokens a grammar forces (llguidance's fast-forward tokens) on real vocabularies: what is forced along a profile
answered as JSON, recorded for the tiny and the SmolLM2 tokenizers; every forced position's mask; the chain pushing
a forced run as drafts, rolling it back when the round is cut before it, stopping at its limit and at the grammar's
end; nothing forced without a constraint, with jump_forward off or where the grammar leaves a choice; the
statistics that count forced tokens apart; and the setting on the command line and the HTTP API."""

from __future__ import annotations

import json
from importlib.resources import files

import click
import numpy as np
import pytest
from click.testing import CliRunner

from fsd_local.chain import Chain
from fsd_local.llama.model import Model, ModelOptions
from fsd_local.settings import Settings
from fsd_local.stats import Stats

# a profile: 5 fields, among them an array of enum values, a nested object and a boolean
PROFILE = json.loads(files("fsd_local").joinpath("data/profile-schema.json").read_text())
ANSWER = (
    '{"name":"Ana Silva","age":34,"languages":["English","French"],'
    '"address":{"city":"Lyon","country":"France"},"employed":true}'
)
# what the grammar forces from the state after ANSWER's first i tokens (the states where it forces anything), as
# recorded with llguidance 1.9.1: the tokens of the forced bytes, less those a longer token could absorb
SMOLLM2_FORCED = {
    0: ['{"', "name"],  # the bytes '{"name":"' are forced; '":"' is held back: '":"A' and the like are tokens
    1: ["name"],
    7: ["age", '":'],
    8: ['":'],
    11: [',"', "l", "anguages", '":'],
    12: ["l", "anguages", '":'],
    13: ["anguages", '":'],
    14: ['":'],  # the '[' after it may merge with the string's quote ('["')
    20: [',"', "address", '":', '{"', "city"],
    21: ["address", '":', '{"', "city"],
    22: ['":', '{"', "city"],
    23: ['{"', "city"],
    24: ["city"],
    29: ["country"],
    33: [',"', "employed", '":'],
    34: ["employed", '":'],
    35: ['":'],
    37: ["}"],
}
# the tiny vocabulary has one token per character and no merges: every forced byte is a forced token
TINY_FORCED_FROM = {
    0: '{"name":"',
    19: ',"age":',
    28: ',"languages":[',
    44: 'nglish"',  # an enum value once its first letter is out
    52: '"',  # after a comma in the array, a value (every enum value is a string)
    54: 'rench"',
    61: ',"address":{"city":"',
    86: ',"country":"',
    105: '},"employed":',
    119: "rue}",  # true once begun, and the end of the object
}


@pytest.fixture(scope="module")
def smollm2():
    from fsd_local.pairs.demo import smollm2_path

    m = Model(ModelOptions(str(smollm2_path()), vocab_only=True))
    yield m
    m.close()


@pytest.fixture(scope="module")
def tiny(tiny_pair):
    m = Model(ModelOptions(tiny_pair[1], vocab_only=True))
    yield m
    m.close()


def _ids(model: Model, text: str) -> list[int]:
    ids = model.tokenize(text, add_special=False)
    if model.piece(ids[0]).startswith(b" "):  # the tiny vocabulary's tokenizer puts a space in front
        ids = ids[1:]
    assert b"".join(model.piece(t) for t in ids) == text.encode()
    return ids


def _allowed(mask: np.ndarray, n: int) -> list[int]:
    return [i for i in range(n) if (int(mask[i >> 5]) >> (i & 31)) & 1]


def _forced_along(model: Model, text: str, settings: Settings) -> dict[int, list[int]]:
    """The forced run at each state along text (a new chain per state, walked there token by token), checking
    that every forced position's mask allows its token and nothing else."""
    ids, runs = _ids(model, text), {}
    walk = Chain(settings, model.n_vocab, model)
    for i, t in enumerate(ids):
        chain = Chain(settings, model.n_vocab, model)
        for tok in ids[:i]:
            chain.settle(0, tok)
        run = chain.force(len(ids))
        assert run == walk.constraint.forced(len(ids)), i  # the same state, reached the same way
        if run:
            runs[i] = run
            assert run == ids[i : i + len(run)], (i, [model.piece(r) for r in run])
            for j, tok in enumerate(run):  # llguidance masks a forced position down to its one token
                assert _allowed(chain.constraint.mask(j), model.n_vocab) == [tok], (i, j)
        walk.settle(0, t)
    assert walk.finished
    return runs


def test_what_a_profile_schema_forces_on_the_smollm2_tokenizer(smollm2):
    runs = _forced_along(smollm2, ANSWER, Settings(json_schema=PROFILE))
    assert {i: [smollm2.piece(t).decode() for t in r] for i, r in runs.items()} == SMOLLM2_FORCED
    forced = sum(1 for i in range(len(_ids(smollm2, ANSWER))) if i in runs)
    assert forced == 18 and len(_ids(smollm2, ANSWER)) == 38  # 47% of the answer's tokens: keys and punctuation


def test_what_a_profile_schema_forces_on_the_tiny_tokenizer(tiny):
    runs = _forced_along(tiny, ANSWER, Settings(json_schema=PROFILE))
    text = {i: b"".join(tiny.piece(t) for t in r).decode() for i, r in runs.items()}
    for i, want in TINY_FORCED_FROM.items():
        assert text[i] == want, i
        assert all(text[i + j] == want[j:] for j in range(len(want))), i  # and the rest of it from each state on
    assert sum(len(r) for i, r in runs.items() if i in TINY_FORCED_FROM) == len("".join(TINY_FORCED_FROM.values()))
    assert set(runs) == {i + j for i, want in TINY_FORCED_FROM.items() for j in range(len(want))}


def _row_masks(chain: Chain, n_rows: int, n: int) -> list[list[int]]:
    rows = np.zeros((n_rows, n), np.float32)
    chain.target_rows(rows, n_rows - 1)
    return [list(np.flatnonzero(np.isfinite(r))) for r in rows]


def _fresh(settings: Settings, model: Model, tokens: list[int]) -> Chain:
    chain = Chain(settings, model.n_vocab, model)
    for t in tokens:
        chain.settle(0, t)
    return chain


def test_a_forced_run_is_pushed_as_drafts_and_kept_whole(tiny):
    s, n = Settings(json_schema=PROFILE), tiny.n_vocab
    ids = _ids(tiny, ANSWER)
    chain = Chain(s, n, tiny).start([1])
    run = chain.force(100)
    assert b"".join(tiny.piece(t) for t in run) == b'{"name":"'
    assert chain.constraint.depth == len(run) and chain.n_pending == len(run)
    masks = _row_masks(chain, len(run) + 1, n)
    for j in range(len(run) + 1):  # row j: the state after the forced tokens before it
        assert masks[j] == _allowed(_fresh(s, tiny, run[:j]).constraint.mask(0), n), j
    chain.settle(len(run), ids[len(run)])  # the target kept the run and wrote the name's first letter
    assert list(chain.text[: chain.size]) == [1, *run, ids[len(run)]]
    assert _allowed(chain.constraint.mask(0), n) == _allowed(_fresh(s, tiny, ids[: len(run) + 1]).constraint.mask(0), n)
    assert chain.force(100) == []  # inside a free string nothing is forced


def test_a_forced_run_after_a_rejected_draft_rolls_back_with_it(tiny):
    """sd/fsd extend a draft with what the grammar forces after it: a rejection before the run drops the run."""
    s, n = Settings(json_schema=PROFILE), tiny.n_vocab
    ids = _ids(tiny, ANSWER)
    end = ANSWER.index('","age"') + 1  # the name's closing quote
    head = _ids(tiny, ANSWER[: end - 1])
    chain = _fresh(s, tiny, head)
    chain.push(ids[len(head)])  # a draft closes the string
    run = chain.force(100)
    assert b"".join(tiny.piece(t) for t in run) == b',"age":'
    _row_masks(chain, len(run) + 2, n)
    other = _ids(tiny, "x")[0]
    chain.settle(0, other)  # the target rejected the quote and wrote "x": the name goes on, the run is gone
    fresh = _fresh(s, tiny, [*head, other])
    assert _allowed(chain.constraint.mask(0), n) == _allowed(fresh.constraint.mask(0), n)
    assert chain.force(100) == [] and chain.n_pending == 0
    # cut inside the run (a stop string or max_tokens ended the reply there): the state is the kept prefix's
    chain = _fresh(s, tiny, head)
    chain.push(ids[len(head)])
    run = chain.force(100)
    _row_masks(chain, len(run) + 2, n)
    chain.settle(3, run[2])  # the quote and ',"' kept, 'a' emitted by the target
    kept = [*head, ids[len(head)], *run[:3]]
    assert chain.force(100) == run[3:]
    chain.settle(0, run[3])
    assert _allowed(chain.constraint.mask(0), n) == _allowed(_fresh(s, tiny, [*kept, run[3]]).constraint.mask(0), n)


def test_a_forced_run_stops_at_its_limit_and_at_the_grammar_end(tiny):
    literal = b"the quick brown fox jumps over the lazy dog."
    s, n = Settings(grammar=f'root ::= "{literal.decode()}"'), tiny.n_vocab
    chain = Chain(s, n, tiny)
    assert len(chain.force(5)) == 5  # what max_tokens and the context leave (the round's room)
    assert chain.force(0) == []
    run = chain.force(100)
    assert b"".join(tiny.piece(t) for t in chain.pending[: chain.n_pending]) == literal
    assert len(run) == 44 - 5 and chain.constraint.finished  # the whole literal: the grammar is complete
    assert chain.force(100) == []  # only the end of the reply may follow: never forced, the round decides it
    masks = _row_masks(chain, 45, n)
    assert all(tiny.is_eog(t) for t in masks[44]) and masks[44]
    chain.settle(44, masks[44][0])
    assert chain.finished and chain.force(100) == []


def test_nothing_is_forced_without_a_choice_left_to_the_grammar(tiny):
    n = tiny.n_vocab
    free = Chain(Settings(grammar='root ::= [a-z]+ "."'), n, tiny)
    assert free.force(100) == [] and free.n_pending == 0  # a grammar that forces nothing
    off = Chain(Settings(json_schema=PROFILE, jump_forward=False), n, tiny)
    assert off.force(100) == [] and off.constraint.forced(100)  # forced, but not proposed
    plain = Chain(Settings(), n, tiny)
    assert plain.force(100) == [] and not plain.active


def test_forced_tokens_are_counted_apart_from_the_drafters():
    st = Stats()
    # a round of 2 drafts, then 3 forced tokens, then 1 draft: the target kept all but the last, and emitted one
    reasons = np.array([1, 2, 1, 1, 1, 0], np.uint8)
    forced = np.array([0, 0, 1, 1, 1, 0], np.uint8)
    divs = np.array([0.01, 0.1, 0.0, 0.0, 0.0, 0.3])
    st.record_round(6, reasons, divs, np.zeros(0), 6, np.zeros(7), forced)
    st.record_round(2, np.array([1, 0], np.uint8), np.full(2, np.nan), np.zeros(0), 2, np.zeros(3), [1, 1])
    d = st.to_dict()
    assert (d["forced"], d["forced_accepted"], d["drafted"], d["accepted_sd"], d["accepted_fuzzy"]) == (5, 4, 3, 1, 1)
    assert d["drafted_by_position"] == [1, 1, 0, 0, 0, 1] and d["accepted_by_position"] == [1, 1, 0, 0, 0, 0]
    assert d["divergences_computed"] == 3 and d["tokens"] == 8 and d["forced_share"] == 4 / 8
    assert d["acceptance_rate"] == 2 / 3  # the drafter's own, forced tokens aside
    st.record_round(3, np.array([1, 1, 1], np.uint8), np.zeros(3), np.zeros(0), 2, np.zeros(4), [1, 1, 1])
    assert st.forced == 8 and st.forced_accepted == 6  # the third was after the reply's end


def test_jump_forward_is_on_by_default_and_off_by_flag_and_by_request(tiny_engine):
    from fsd_local.cli.options import pop_settings, settings_options
    from fsd_local.server.openai_schema import parse, settings_for

    assert Settings().jump_forward and not Settings(jump_forward=False).jump_forward

    @click.command()
    @settings_options
    def show(**kw):
        click.echo(pop_settings(kw).jump_forward)

    assert CliRunner().invoke(show, []).output.strip() == "True"
    assert CliRunner().invoke(show, ["--no-jump-forward"]).output.strip() == "False"
    assert CliRunner().invoke(show, ["--jump-forward"]).output.strip() == "True"
    body = {"messages": [{"role": "user", "content": "hi"}], "jump_forward": False}
    assert settings_for(tiny_engine, parse("chat", json.dumps(body).encode())).jump_forward is False
    del body["jump_forward"]
    assert settings_for(tiny_engine, parse("chat", json.dumps(body).encode())).jump_forward is True
