"""The prompt contract (fsd_local/prompting.py), kept alike by an in-process Engine and by the server's Supervisor with
its real child process: the target's template and one BOS, a sampled reply's cached tokens spliced into the next
prompt, the shared vocabulary, the contexts as loaded. The tiny target has a template that writes BOS itself and
two more (control) tokens than the draft; the models are loaded with n_ctx=0, which llama.cpp reads as "the
model's own" (512)."""

from __future__ import annotations

import pytest

from fsd_local import Engine
from fsd_local.errors import ConfigError, ContextOverflowError
from fsd_local.llama.options import ModelOptions
from fsd_local.server.supervisor import Supervisor
from support.tinymodels import write_tiny_gguf
from support.tool_templates import with_template

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
BOS, DRAFT_VOCAB, TRAINED_CTX = 1, 292, 512
LETTERS = range(3 + 0x61, 3 + 0x7B)  # the byte tokens of a..z: the tokenizer itself writes letters as words


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract")
    draft = write_tiny_gguf(d / "draft.gguf", seed=1, n_ctx=TRAINED_CTX)
    plain = write_tiny_gguf(d / "plain.gguf", seed=2, noise=0.1, n_ctx=TRAINED_CTX, control=("<x0>", "<x1>"))
    return str(draft), str(with_template(plain, d / "target.gguf", TEMPLATE))


@pytest.fixture(scope="module", params=["engine", "supervisor"])
def pair(request, models):
    draft, target = (ModelOptions(p, n_ctx=0, n_threads=1) for p in models)
    make = Engine if request.param == "engine" else Supervisor
    with make(target, draft) as p:
        yield p


def test_a_chat_is_the_targets_template_with_one_bos(pair):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = "<s>system: be brief\nuser: hello\nassistant: "
    assert pair.chat_template().render(msgs) == text
    ids = pair.chat_prompt(msgs)
    assert ids == pair.tokenize(text, add_special=False) and ids.count(BOS) == 1 and ids[0] == BOS
    assert pair.prompt_tokens("hello")[0] == BOS  # a plain prompt: the tokenizer adds it


def test_ids_are_checked_against_the_shared_vocabulary(pair):
    assert pair.n_vocab == DRAFT_VOCAB  # the target has two more
    assert pair.prompt_tokens([BOS, DRAFT_VOCAB - 1]) == [BOS, DRAFT_VOCAB - 1]
    with pytest.raises(ConfigError, match=rf"token id {DRAFT_VOCAB} is outside the vocabulary \(0..291\)"):
        pair.prompt_tokens([BOS, DRAFT_VOCAB])


def test_the_loaded_context_bounds_a_prompt(pair):
    assert pair.target.n_ctx == TRAINED_CTX and pair.draft is not None and pair.draft.n_ctx == TRAINED_CTX
    assert len(pair.prompt_tokens([BOS] * TRAINED_CTX)) == TRAINED_CTX
    with pytest.raises(ContextOverflowError, match=f"the context holds {TRAINED_CTX}"):
        pair.prompt_tokens([BOS] * (TRAINED_CTX + 1))


def test_a_sampled_replys_own_tokens_are_spliced_into_the_next_prompt(pair):
    """A reply in byte tokens, where the tokenizer writes words: the next turn's prompt keeps the reply's tokens
    as the target holds them, so only the new text is evaluated."""
    msgs = [{"role": "user", "content": "spell"}]
    first_prompt = pair.chat_prompt(msgs)
    only_letters = {t: float("-inf") for t in range(DRAFT_VOCAB) if t not in LETTERS}
    first = pair.generate(first_prompt, mode="sd", temperature=0, max_tokens=8, logit_bias=only_letters)
    assert len(first.token_ids) == 8 and set(first.token_ids) <= set(LETTERS) and first.text.isalpha()
    held = list(pair.cached_tokens())
    assert (
        len(first_prompt) < len(held) <= len(first_prompt) + 8 and held == (first_prompt + first.token_ids)[: len(held)]
    )
    nxt = [*msgs, {"role": "assistant", "content": first.text}, {"role": "user", "content": "again"}]
    canonical = pair.tokenize(pair.chat_template().render(nxt), add_special=False)
    spliced = pair.chat_prompt(nxt)
    assert spliced[: len(held)] == held and spliced != canonical
    assert pair.detokenize(spliced) == pair.detokenize(canonical)
    second = pair.generate(spliced, mode="sd", temperature=0, max_tokens=1)
    assert second.stats["prompt_evaluated"] == len(spliced) - len(held)
