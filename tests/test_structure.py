"""The package's shape: its modules import one another without cycles, and no source file is long.

The import graph is read from the source with `ast`, not by importing: every kvgen/**/*.py is a
module (a package's __init__.py is the package), and each `import kvgen...` / `from kvgen... import`
/ relative import in it, at any depth, is an edge to the most specific kvgen module it names
(`from kvgen.bench import serve` -> kvgen.bench.serve, `from kvgen.loaders import LoadedModel` ->
kvgen.loaders). Imports in functions count (they run when called), and so do those under
`if TYPE_CHECKING:`: they never run, but the annotation still ties the two modules' designs together,
so a cycle through one is still a circle to untangle (the model's llama <-> fused is one). The parent
packages Python imports first (`import kvgen.server.app` runs kvgen/server/__init__.py) are not
edges: an __init__ that re-exports its submodules would otherwise be a cycle with each of them.

On that graph, every import runs down the layers (issue 41), each layer importing its own modules
and those below it, never one above:

    front ends   the commands and what only they use: cli, commands, options, option_space, kv_view,
                 server, chat, bench, eval, models_cli (ls, pull)
    api          what a program calls: the package itself (`from kvgen import LLM`), llm, async_llm,
                 replicas (which hand their readings up to the server's /metrics, never the reverse)
    engine       engine/ (the step, its front ends' shared rules, speculation), distributed/ (TP ranks)
    runner       runner/ (a step's batch laid out and run), phases (one sequence, prefill and decode),
                 gpu/ (the CUDA backends and decode graphs a runner is given)
    scheduling   scheduling/: a request's state, who runs each step, and output.py, the step handed
                 to the runner (the runner reads that module, never the scheduler)
    sampling     sampling_params, sample/ (sampler, rejection sampler, grammars)
    cache        cache/: block pool, KV manager, hybrid cache, policies, sizing
    model        model/
    loaders      loaders/ (formats, tensor-parallel shard rules), tokenizer (the interface they implement)
    config       config, architectures (a pure table of what each architecture is)
    base         errors, paths, threads: no kvgen import but each other's, so every layer may use them

A module belongs to the layer of the longest name in LAYERS that is it or a package above it (the
package itself, `kvgen`, only by its own name); a module in no layer fails the test, so a new room is
placed on purpose. The front ends sit above the api because the server wraps AsyncLLM and ReplicaSet.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvgen

PACKAGE_DIR = Path(kvgen.__file__).resolve().parent

# Import cycles allowed, each as its strongly connected set of modules: none. An entry that is no
# longer a cycle fails the test too, so the list cannot outlive one.
ALLOWED_CYCLES: set[frozenset[str]] = set()

# Top to bottom; see the module's docstring.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("front ends", ("kvgen.__main__", "kvgen.cli", "kvgen.commands", "kvgen.options", "kvgen.option_space",
                    "kvgen.kv_view", "kvgen.server", "kvgen.chat", "kvgen.bench", "kvgen.eval",
                    "kvgen.models_cli")),
    ("api", ("kvgen", "kvgen.llm", "kvgen.async_llm", "kvgen.replicas")),
    ("engine", ("kvgen.engine", "kvgen.distributed")),
    ("runner", ("kvgen.runner", "kvgen.phases", "kvgen.gpu")),
    ("scheduling", ("kvgen.scheduling",)),
    ("sampling", ("kvgen.sampling_params", "kvgen.sample")),
    ("cache", ("kvgen.cache",)),
    ("model", ("kvgen.model",)),
    ("loaders", ("kvgen.loaders", "kvgen.tokenizer")),
    ("config", ("kvgen.config", "kvgen.architectures")),
    ("base", ("kvgen.errors", "kvgen.paths", "kvgen.threads")),
]

# Imports allowed to run up the layers, as (importer, imported): none. An entry that is no longer an
# upward import fails the test too, so this list cannot outlive one.
ALLOWED_UPWARD_IMPORTS: set[tuple[str, str]] = set()

MAX_LINES = 450
SOURCE_SUFFIXES = {".py", ".c", ".h", ".js", ".css", ".html"}
# Source files allowed over MAX_LINES: files under kvgen/model/ only (the model's engineer's), as
# paths relative to kvgen/. None today.
LONG_FILES_ALLOWED: set[str] = set()


def module_name(path: Path) -> str:
    parts = ("kvgen", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_paths() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _named_modules(statement: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> Iterator[str]:
    """The dotted names an import statement may refer to, most specific first per name."""
    if isinstance(statement, ast.Import):
        yield from (alias.name for alias in statement.names)
        return
    base = statement.module or ""
    if statement.level:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        anchor = package[:len(package) - statement.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    for alias in statement.names:
        yield f"{base}.{alias.name}"


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a kvgen module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = module_paths()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for statement in _imports(tree):
            for named in _named_modules(statement, name, path.name == "__init__.py"):
                target = _resolve(named, modules)
                if target is not None and target != name:
                    graph[name].add(target)
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for target in graph[stack.pop()] - seen:
            seen.add(target)
            stack.append(target)
    return seen


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The graph's strongly connected sets of more than one module: the modules that reach each other."""
    reach = {name: _reachable(graph, name) for name in graph}
    return {frozenset({name} | {other for other in reach[name] if name in reach[other]})
            for name in graph if name in reach[name]}


def test_the_graph_sees_imports_in_functions_and_for_type_checking():
    graph = import_graph()
    assert "kvgen.llm" in graph["kvgen.server.cli"]  # imported inside _model_name
    assert "kvgen.loaders.gguf_tensors" in graph["kvgen.loaders.weights"]  # under `if TYPE_CHECKING:`
    assert "kvgen.bench.serve" in graph["kvgen.bench.cli"]  # `from kvgen.bench import serve`, in a function
    assert import_cycles({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == {frozenset({"a", "b"})}


def test_no_import_cycles_but_the_allowed_ones():
    cycles = import_cycles(import_graph())
    assert cycles - ALLOWED_CYCLES == set(), "new import cycles: break them (or explain them in ALLOWED_CYCLES)"
    assert ALLOWED_CYCLES - cycles == set(), "these are no longer cycles: take them out of ALLOWED_CYCLES"


def layer_of(module: str) -> str | None:
    """The layer of a module: that of the longest LAYERS name that is the module or a package above it."""
    best, layer = "", None
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            covers = module == prefix or (prefix != "kvgen" and module.startswith(prefix + "."))
            if covers and len(prefix) > len(best):
                best, layer = prefix, name
    return layer


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every (importer, imported) whose imported module sits in a layer above the importer's (modules in
    no layer are test_every_module_has_a_layer's to report)."""
    rank = {name: i for i, (name, _) in enumerate(LAYERS)}
    ranks = {name: rank.get(layer_of(name), -1) for name in graph}
    return {(importer, imported) for importer, targets in graph.items() for imported in targets
            if min(ranks[importer], ranks[imported]) >= 0 and ranks[imported] < ranks[importer]}


def test_layers_are_read_by_the_longest_name():
    assert layer_of("kvgen") == "api" and layer_of("kvgen.cli") == "front ends"
    assert layer_of("kvgen.sample.sampler") == "sampling" and layer_of("kvgen.sampling_params") == "sampling"
    assert layer_of("kvgen.somewhere_new") is None  # the package's name does not cover its modules
    assert upward_imports({"kvgen.cache.block_pool": {"kvgen.engine.base", "kvgen.errors"},
                           "kvgen.engine.base": {"kvgen.cache.block_pool"}, "kvgen.errors": set()}) \
        == {("kvgen.cache.block_pool", "kvgen.engine.base")}


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in module_paths() if layer_of(name) is None)
    assert unplaced == [], f"modules in no layer: add them to LAYERS (and the docstring's drawing): {unplaced}"


def test_imports_run_down_the_layers():
    upward = upward_imports(import_graph())
    described = {(a, b): f"{layer_of(a)} -> {layer_of(b)}" for a, b in upward - ALLOWED_UPWARD_IMPORTS}
    assert described == {}, "imports that run up the layers: move the imported code down, or split it"
    assert ALLOWED_UPWARD_IMPORTS - upward == set(), "no longer upward: take them out of ALLOWED_UPWARD_IMPORTS"


def _source_files() -> Iterator[Path]:
    return (p for p in PACKAGE_DIR.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts)


def test_no_source_file_over_450_lines():
    assert all(path.startswith("model/") for path in LONG_FILES_ALLOWED), "the allowance is kvgen/model/'s only"
    lengths = {p.relative_to(PACKAGE_DIR).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
               for p in _source_files()}
    long_files = {path: n for path, n in lengths.items() if n > MAX_LINES}
    assert set(long_files) - LONG_FILES_ALLOWED == set(), f"over {MAX_LINES} lines: {long_files}"
    assert LONG_FILES_ALLOWED - set(long_files) == set(), "within the limit now: take them out of LONG_FILES_ALLOWED"
