"""The shape of the package: layers without import cycles, small modules, a command line that starts without
Numba or llama.cpp, and settings declared in one place."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from fsd_local.cli import cli
from fsd_local.cli.chat import SETTERS
from fsd_local.server.openai_schema import SETTING_FIELDS, ChatRequest
from fsd_local.settings import FIELDS, Settings, spec

PACKAGE = Path(__file__).resolve().parent.parent / "fsd_local"
MAX_LINES = 450  # "about 400": ruff format puts long calls one argument per line


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of the package that `path` imports when it is imported (not inside functions, not for typing)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsd_local"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out & modules


def test_no_import_cycles():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _module_level_imports(p, set(files)) - {m} for m, p in files.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_modules_stay_small():
    big = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_help_and_models_load_neither_numba_nor_llama_cpp():
    code = (
        "import sys; from click.testing import CliRunner; from fsd_local.cli import cli\n"
        "for args in (['--help'], ['models'], ['chat', '--help'], ['generate', '--help']):\n"
        "    r = CliRunner().invoke(cli, args); assert r.exit_code == 0, r.output\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'numba', 'llama_cpp', 'llvmlite', 'fastapi'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_every_setting_is_declared_with_help_and_exposed_where_it_says():
    help_text = CliRunner().invoke(cli, ["generate", "--help"]).output
    for f in FIELDS:
        s = spec(f)
        assert s.help, f.name
        if s.cli:
            assert s.cli in help_text, f.name
        if s.http and f.name != "max_tokens":
            assert f.name in SETTING_FIELDS and f.name in ChatRequest.model_fields, f.name
        if s.chat:
            assert SETTERS[s.chat][0] == f.name
    assert set(SETTING_FIELDS) | {"max_tokens"} == {f.name for f in FIELDS if spec(f).http}
    assert {c for c, _ in SETTERS.items()} == {spec(f).chat for f in FIELDS if spec(f).chat}


def test_divergence_topk_has_its_own_name_flag_and_the_old_alias():
    assert Settings().with_(topk=7).divergence_topk == 7
    help_text = CliRunner().invoke(cli, ["generate", "--help"]).output
    assert "--divergence-topk" in help_text and "--top-k" in help_text
