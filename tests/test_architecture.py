"""The shape of the package: imports that point down the layers, no import cycles, small modules and functions, a
command line that starts without Numba or llama.cpp, and settings declared in one place.

The layers, bottom to top (LAYERS below; a package is placed whole, a module by its dotted name,
which comes first):

0. foundation: the package root (its version; the public names are loaded by name on first use), errors, paths,
   setting_spec, schema_bounds, constrain, stats, stream, results, conversation, engine_like, prompting, and
   kernels/names.py (the kernels' named tuples' fields and constants, Numba-free: what stats reads the budget
   state by)
1. kernels/ (Numba), llama/ (llama.cpp through its C API)
2. settings, tools/
3. drafting/, pairs/, chain, round, policy, device_picks
4. the engine: engine, generation, batching
5. bench/, server/
6. cli/

A module may import from its own layer and the layers below it, never from a layer above, and no chain of imports
may come back to where it started. Every import counts, those inside functions too. An import under
`if TYPE_CHECKING:` never runs, so it may name a type of a higher layer (the server's protocol names the result
types), but it still counts for cycles: a lower module annotated with a higher one's type is a module that cannot
be read, tested or swapped without it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from fsd_local.cli import cli
from fsd_local.cli.chat import SETTERS
from fsd_local.server.openai_schema import SETTING_FIELDS, ChatRequest
from fsd_local.settings import FIELDS, Settings, spec

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fsd_local"
SOURCES = (PACKAGE, ROOT / "tests", ROOT / "benchmarks")  # what the size and formatting rules cover
MAX_LINES = 450  # "about 400": ruff format puts long calls one argument per line
MAX_FUNCTION_LINES = 80
# (file, function) pairs allowed over MAX_FUNCTION_LINES (and formatter escapes inside them) for now, with the owner
LONG_FUNCTIONS = {}
LAYERS = (  # bottom first: names under fsd_local (a package stands for every module in it)
    (
        "fsd_local",
        "errors",
        "paths",
        "setting_spec",
        "schema_bounds",
        "constrain",
        "stats",
        "stream",
        "results",
        "conversation",
        "engine_like",
        "prompting",
        "kernels.names",
    ),
    ("kernels", "llama"),
    ("settings", "tools"),
    ("drafting", "pairs", "chain", "round", "policy", "device_picks"),
    ("engine", "generation", "batching"),
    ("bench", "server"),
    ("cli",),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    """The layer of a module of the package (KeyError: a module no layer names)."""
    parts = module.split(".")
    for name in (".".join(parts[1:]), ".".join(parts[1:2])):
        for i, layer in enumerate(LAYERS):
            if (name or "fsd_local") in layer:
                return i
    raise KeyError(module)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, modules: set[str], typing: bool = False) -> dict[str, int]:
    """The modules of the package that `path` imports at run time (at module level or inside functions; with
    `typing`, under TYPE_CHECKING too), each with the line of its first import."""
    out: dict[str, int] = {}

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node) and not typing:
            for child in getattr(node, "orelse", []):
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    out.setdefault(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import (the package imports absolutely)"
            if node.module and node.module.split(".")[0] == "fsd_local":
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.setdefault(sub if sub in modules else node.module, node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m: line for m, line in out.items() if m in modules}


def _graph(typing: bool = False) -> dict[str, dict[str, int]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {n: line for n, line in _imports(p, set(files), typing).items() if n != m} for m, p in files.items()}


def test_every_module_has_a_layer():
    unplaced = []
    for m in _graph():
        try:
            _layer(m)
        except KeyError:
            unplaced.append(m)
    assert not unplaced, f"modules no layer names (add them to LAYERS, and to the docstring): {unplaced}"
    named = {name for layer in LAYERS for name in layer}
    present = {part for m in _graph() for part in (m.partition(".")[2], m.partition(".")[2].split(".")[0]) if part}
    present.add("fsd_local")
    assert named <= present, f"LAYERS names modules that do not exist: {sorted(named - present)}"


def test_imports_point_down_the_layers():
    upward = [
        f"{m} (layer {_layer(m)}) imports {n} (layer {_layer(n)}) at line {line}"
        for m, imports in sorted(_graph().items())
        for n, line in sorted(imports.items())
        if _layer(n) > _layer(m)
    ]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    """Type-only imports included (the module docstring)."""
    graph = _graph(typing=True)
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


def _python_files():
    for root in SOURCES:
        yield from sorted(root.rglob("*.py"))


def _long_functions(path: Path) -> dict[str, tuple[int, int]]:
    """Functions (and methods) of `path` over MAX_FUNCTION_LINES, by name: (first line, last line)."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                out[node.name] = (node.lineno, node.end_lineno)
    return out


def test_modules_stay_small():
    big = {
        str(p.relative_to(ROOT)): n
        for p in _python_files()
        if p.parent != ROOT / "tests" and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_functions_stay_short():
    long = [
        f"{p.relative_to(ROOT)}:{first} {name}: {last - first + 1} lines"
        for p in _python_files()
        for name, (first, last) in _long_functions(p).items()
        if (str(p.relative_to(ROOT)), name) not in LONG_FUNCTIONS
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them by what they do):\n" + "\n".join(long)


def test_nothing_is_squeezed_past_the_formatter():
    """No formatter escapes (ruff format's skip and off pragmas): a line too long for the formatter's layout is a
    function to split."""
    markers = ("fmt: " + "skip", "fmt: " + "off")
    found = []
    for p in _python_files():
        exempt = [span for (f, name), span in _spans(p) if (f, name) in LONG_FUNCTIONS]
        for i, line in enumerate(p.read_text().splitlines(), start=1):
            if any(m in line for m in markers) and not any(a <= i <= b for a, b in exempt):
                found.append(f"{p.relative_to(ROOT)}:{i}")
    assert not found, f"formatter escapes: {found}"


MAX_DOCSTRING_LINES = 3


def test_docstrings_stay_short():
    """A docstring says in 1-3 lines what is true of the code; the why goes in docs/design.md, figures in
    docs/measurements."""
    long = []
    for p in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and (n := len(doc.splitlines())) > MAX_DOCSTRING_LINES:
                    long.append(f"{p.relative_to(ROOT)}: {getattr(node, 'name', '(module)')}: {n} lines")
    assert not long, f"docstrings over {MAX_DOCSTRING_LINES} lines:\n" + "\n".join(long)


def _spans(path: Path):
    rel = str(path.relative_to(ROOT))
    return [((rel, name), span) for name, span in _long_functions(path).items()]


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded once it has run `code`."""
    code += "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_help_and_models_load_neither_numba_nor_llama_cpp():
    loaded = _modules_after(
        "from click.testing import CliRunner; from fsd_local.cli import cli\n"
        "for args in (['--help'], ['models'], ['chat', '--help'], ['generate', '--help']):\n"
        "    r = CliRunner().invoke(cli, args); assert r.exit_code == 0, r.output"
    )
    assert not {m.split(".")[0] for m in loaded} & {"numba", "llama_cpp", "llvmlite", "fastapi"}


def test_the_servers_http_process_loads_neither_numba_nor_the_engine():
    """`fsd-local serve` runs the models in a child (server/child.py): the HTTP process tokenises with llama.cpp's
    vocabulary but never loads the engine, its kernels or Numba."""
    loaded = _modules_after("import fsd_local.server.app, fsd_local.server.running")
    assert not {m.split(".")[0] for m in loaded} & {"numba", "llvmlite"}
    assert "fsd_local.engine" not in loaded and "fsd_local.server.app" in loaded


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
