"""Benchmark prompts: a prompts file (plain text, one prompt a line, or JSON Lines with optional answers) read into
`Prompt`s, and an answer pulled out of a completion (`letter`, `number` or `regex`; docs/benchmarking.md)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from fsd_local.errors import ConfigError

EXTRACTORS = ("letter", "number", "regex")
EXAMPLE_FILE = Path(__file__).parent.parent / "data" / "prompts-example.jsonl"

# Letters: an explicit "answer is (B)" wins, then a letter opening the output ("(B)", "B." or "B" alone), then
# any "(B)". A bare capital elsewhere, or followed by a space, is not trusted: "A" and "I" are English words.
# Lower case only counts inside parentheses: "(d)" is a choice, "answer is a dolphin" is not.
_LETTER_RES = (
    re.compile(r"(?i:answer)\s*(?:(?i:is)|:)?\s*:?\s*(?:\(([A-Ja-j])\)|([A-J])(?![\w']))"),
    re.compile(r"^\s*(?:\(([A-Ja-j])\)|([A-J])(?:[).:,]|$))"),
    re.compile(r"\(([A-Ja-j])\)"),
)
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_ANSWER_NUMBER_RE = re.compile(r"answer\s*(?:is|:)?\s*:?\s*\$?(" + _NUMBER + ")", re.IGNORECASE)
_NUMBER_RE = re.compile(_NUMBER)


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str | None = None
    extract: str | None = None
    pattern: re.Pattern | None = None

    def extract_answer(self, output: str) -> str | None:
        """The answer found in `output` by this prompt's extractor (None when none is found)."""
        return extract_answer(output, self.extract, self.pattern)

    def is_correct(self, output: str) -> bool | None:
        """None when the prompt carries no answer."""
        if self.answer is None:
            return None
        return answers_match(self.extract, self.extract_answer(output), self.answer)


def extract_answer(output: str, extract: str | None, pattern: re.Pattern | None = None) -> str | None:
    if extract == "letter":
        for rx in _LETTER_RES:
            m = rx.search(output)
            if m:
                return next(g for g in m.groups() if g).upper()
        return None
    if extract == "number":
        # the number after the last "answer is"/"answer:", else the last number in the output
        hits = _ANSWER_NUMBER_RE.findall(output) or _NUMBER_RE.findall(output)
        return hits[-1].replace(",", "") if hits else None
    if extract == "regex":
        assert pattern is not None, 'extract "regex" needs a pattern'  # _prompt_from_json checks it
        m = pattern.search(output)
        if m is None:
            return None
        return (m.group(1) if pattern.groups else m.group(0)).strip()
    raise ConfigError(f"unknown extract {extract!r}; choose one of {', '.join(EXTRACTORS)}")


def answers_match(extract: str | None, found: str | None, expected: str) -> bool:
    if found is None:
        return False
    if extract == "number":
        a, b = float(found), float(expected)
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if extract == "letter":
        return found.upper() == expected.strip().upper()
    return found == expected.strip()


def _guess_extract(answer: str) -> str | None:
    if re.fullmatch(r"[A-Ja-j]", answer):
        return "letter"
    if re.fullmatch(_NUMBER, answer):
        return "number"
    return None


def _prompt_from_json(obj, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise ConfigError(f'{where}: expected a JSON object like {{"prompt": "..."}}')
    unknown = set(obj) - {"prompt", "answer", "extract", "pattern"}
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: prompt, answer, extract, pattern"
        )
    text = obj.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f'{where}: "prompt" must be a non-empty string')
    answer = obj.get("answer")
    if answer is None:
        if "extract" in obj or "pattern" in obj:
            raise ConfigError(f'{where}: "extract"/"pattern" given without an "answer"')
        return Prompt(text)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ConfigError(f'{where}: "answer" must be a string or a number')
    answer = str(answer).strip()
    extract = obj.get("extract") or _guess_extract(answer)
    if extract is None:
        raise ConfigError(
            f"{where}: cannot tell how to read answer {answer!r} from the output; "
            f'add "extract": one of {", ".join(EXTRACTORS)}'
        )
    if extract not in EXTRACTORS:
        raise ConfigError(f'{where}: "extract" is {extract!r}; choose one of {", ".join(EXTRACTORS)}')
    pattern = None
    if extract == "regex":
        if not isinstance(obj.get("pattern"), str):
            raise ConfigError(f'{where}: "extract": "regex" needs a "pattern" string')
        try:
            pattern = re.compile(obj["pattern"])
        except re.error as exc:
            raise ConfigError(f'{where}: bad "pattern": {exc}') from None
    elif "pattern" in obj:
        raise ConfigError(f'{where}: "pattern" only applies to "extract": "regex"')
    if extract == "number" and not re.fullmatch(_NUMBER, answer):
        raise ConfigError(f'{where}: "answer" {answer!r} is not a number but "extract" is "number"')
    if extract == "letter" and not re.fullmatch(r"[A-Ja-j]", answer):
        raise ConfigError(f'{where}: "answer" {answer!r} is not a letter A-J but "extract" is "letter"')
    return Prompt(text, answer.replace(",", "") if extract == "number" else answer, extract, pattern)


def parse_prompts(text: str, name: str = "<prompts>", jsonl: bool | None = None) -> list[Prompt]:
    """Prompts from a file's contents; `jsonl` None = decide from the name (.jsonl / .json)."""
    if jsonl is None:
        jsonl = name.endswith((".jsonl", ".json"))
    prompts = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(Prompt(line))
            continue
        where = f"{name} line {no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        prompts.append(_prompt_from_json(obj, where))
    if not prompts:
        raise ConfigError(f"{name}: no prompts in the file")
    return prompts


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Prompts from a file (the shipped example file when None)."""
    path = Path(path) if path is not None else EXAMPLE_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read prompts file {path}: {exc}") from None
    return parse_prompts(text, str(path))
