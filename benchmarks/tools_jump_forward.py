"""Tool calls through the server's /v1/chat/completions with and without jump-forward (issue 41's tools goal): the
same requests, a 3-function tool list and tool_choice "required", sent with the `openai` client to two servers
of this process, one per side, each on its own freshly loaded engine.

    python benchmarks/tools_jump_forward.py --demo f16 [--configs ar,sd,fsd] [--repeats 1] [--tokens 96]
        [--store empty|disk] [--target T.gguf --draft D.gguf]

The demo target cannot express tools with its own chat template, so the script writes a copy of it with a Hermes
template (tests/support/tool_templates.py, the one the tool tests use). Each request is greedy (the calls can be
compared) and carries its configuration and `jump_forward` in the body; for each ask the side that goes first
alternates. tokens/s is the reply's completion tokens over the client's wall seconds for the request (what an
agent waits), summed over the asks; tok/call is completion tokens per target call (the server's `fsd` object);
forced is the share of tokens proposed forced and kept; same: asks whose call (name and arguments) is the same on
both sides. --store empty points FSD_LOCAL_COSTS at a new, empty file per engine (what a fresh install measures);
disk: what the store on disk holds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from time import perf_counter

import openai

from fsd_local import Engine
from fsd_local.pairs.demo import demo_pair
from fsd_local.server import BackgroundServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.tool_templates import TEMPLATES, with_template  # noqa: E402  (the tool tests' templates)


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


CURRENCIES = ["EUR", "USD", "JPY", "GBP", "CHF"]
TOOLS = [
    _function(
        "get_weather",
        "The current weather in a city",
        {"city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city", "unit"],
    ),
    _function(
        "convert_currency",
        "Convert an amount of money from one currency to another",
        {
            "amount": {"type": "number", "minimum": 0},
            "from_currency": {"type": "string", "enum": CURRENCIES},
            "to_currency": {"type": "string", "enum": CURRENCIES},
        },
        ["amount", "from_currency", "to_currency"],
    ),
    _function(
        "create_event",
        "Put an event in the user's calendar",
        {
            "title": {"type": "string", "maxLength": 60},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "all_day": {"type": "boolean"},
        },
        ["title", "date", "all_day"],
    ),
]
ASKS = [
    "What is the weather like in Paris today?",
    "How much is 250 euros in US dollars?",
    "Add my dentist appointment on 2026-12-14 to my calendar, it takes the whole day.",
    "Is it cold in Oslo right now? I use fahrenheit.",
    "Convert 1200 Japanese yen to British pounds, please.",
    "Put 'Team lunch' in my calendar for 2026-12-09.",
]
CONFIGS = {
    "ar": {"mode": "ar"},
    "sd": {"mode": "sd"},
    "sd-k4": {"mode": "sd", "draft_policy": "fixed", "draft_max": 4},
    "fsd": {"mode": "fsd", "divergence": "js", "tau": 0.2},
    "fsd-k4": {"mode": "fsd", "divergence": "js", "tau": 0.2, "draft_policy": "fixed", "draft_max": 4},
}


def ask(client: openai.OpenAI, content: str, body: dict, tokens: int) -> dict:
    """One request: its call, completion tokens, the client's wall seconds and the server's statistics."""
    t = perf_counter()
    r = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": content}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=tokens,
        temperature=0.0,
        extra_body=body,
    )
    wall = perf_counter() - t
    calls = r.choices[0].message.tool_calls or []
    stats = (r.model_extra or {})["fsd"]
    return {
        "call": [(c.function.name, c.function.arguments) for c in calls],
        "finish": r.choices[0].finish_reason,
        "tokens": r.usage.completion_tokens,
        "wall": wall,
        "target_calls": stats["target_calls"],
        "forced": stats.get("forced_accepted", 0),
    }


def engine(target: str, draft: str, store: str, threads: int) -> Engine:
    if store == "empty":
        os.environ["FSD_LOCAL_COSTS"] = os.path.join(tempfile.mkdtemp(), "costs.json")
    return Engine(target=target, draft=draft, n_ctx=4096, n_threads=threads)


def totals(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    return {
        "tok_s": tokens / sum(r["wall"] for r in rows),
        "tok_call": tokens / max(1, sum(r["target_calls"] for r in rows)),
        "forced": sum(r["forced"] for r in rows) / max(1, tokens),
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="f16", choices=("f16", "wide", "q4_1"))
    ap.add_argument("--target", help="a target GGUF instead of a demo pair (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--configs", default="ar,sd,fsd")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=96, help="max_tokens: room for the whole call")
    ap.add_argument("--store", default="empty", choices=("empty", "disk"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--asks", type=int, default=len(ASKS), help="the first N asks")
    a = ap.parse_args()
    if bool(a.target) != bool(a.draft):
        ap.error("--target and --draft go together (a pair of GGUF paths); leave both out for a demo pair")
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    hermes = with_template(str(target), Path(tempfile.mkdtemp()) / "target-hermes.gguf", TEMPLATES["hermes"])
    store = "EMPTY" if a.store == "empty" else "as on disk"
    print(f"target {target} (Hermes template); cost store {store} per engine; {a.asks} asks x {a.repeats}")
    engines = {on: engine(str(hermes), str(draft), a.store, a.threads) for on in (True, False)}
    servers = {on: BackgroundServer(engines[on], model_name="demo") for on in (True, False)}
    try:
        clients = {
            on: openai.OpenAI(base_url=servers[on].url + "/v1", api_key="x", max_retries=0, timeout=600)
            for on in (True, False)
        }
        for on in (True, False):  # untimed: first touches of both models and of llguidance's tokenizer
            ask(clients[on], ASKS[0], {"mode": "sd", "jump_forward": on}, 8)
        print(
            f"{'config':7s} {'tok/s on':>8s} {'off':>6s} {'ratio':>6s} {'tok/call on':>11s} {'off':>5s} "
            f"{'ratio':>6s} {'forced on':>9s} same calls"
        )
        for name in a.configs.split(","):
            rows: dict[bool, list[dict]] = {True: [], False: []}
            for r in range(a.repeats):
                for i, content in enumerate(ASKS[: a.asks]):
                    for on in (True, False) if (r + i) % 2 == 0 else (False, True):
                        body = {**CONFIGS[name], "jump_forward": on}
                        rows[on].append(ask(clients[on], content, body, a.tokens))
            on, off = totals(rows[True]), totals(rows[False])
            same = sum(x["call"] == y["call"] for x, y in zip(rows[True], rows[False]))
            made = sum(bool(x["call"]) and x["finish"] == "tool_calls" for x in rows[True])
            print(
                f"{name:7s} {on['tok_s']:8.2f} {off['tok_s']:6.2f} {on['tok_s'] / off['tok_s']:6.2f} "
                f"{on['tok_call']:11.2f} {off['tok_call']:5.2f} {on['tok_call'] / off['tok_call']:6.2f} "
                f"{on['forced']:9.0%} {same}/{len(rows[True])} ({made} complete calls on)",
                flush=True,
            )
            for x in rows[True][: a.asks]:
                print("   ", x["call"])
    finally:
        for on in (True, False):
            servers[on].close()
            engines[on].close()


if __name__ == "__main__":
    main()
