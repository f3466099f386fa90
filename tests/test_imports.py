"""The package's import graph has no circle: a lower module never imports a higher one.

The graph is read from the source with `ast` (every `import` / `from ... import`, those inside functions
included: a lazy import is still a dependency), one node per module of nanoeuler/. `from .x import y` is
an edge to module x.y when that is a module, else to x. Importing a module runs its package's __init__ as
well; that implicit edge is not counted (else every package would be a circle with its own modules).
"""
from __future__ import annotations

import ast
from pathlib import Path

import nanoeuler

ROOT = Path(nanoeuler.__file__).parent


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """'nanoeuler.fast.engine' -> its file, for every .py under root ('nanoeuler.fast' -> fast/__init__.py)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict) -> set[str]:
    """The modules of the package that module `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import nanoeuler.fast.engine as E` -> the module itself
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None. find_cycle({"a": {"b"}, "b": {"a"}}) -> ['a', 'b', 'a']"""
    state = {}  # node -> "open" while on the current path, "done" after

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and "nanoeuler.fast.engine" in graph["nanoeuler.fast"]  # the graph was read
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_reader_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import low\n")
    (pkg / "sub" / "low.py").write_text("def f():\n    from ..high import g\n")  # a lazy import, upwards
    (pkg / "high.py").write_text("from .sub.low import f\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.low"] == {"pkg.high"} and graph["pkg.high"] == {"pkg.sub.low"}
    assert graph["pkg.sub"] == {"pkg.sub.low"}
    assert find_cycle(graph) == ["pkg.high", "pkg.sub.low", "pkg.high"]


LAYOUT = ROOT.parent / "docs" / "layout.md"


def picture_layers(page: Path = LAYOUT) -> list[list[str]]:
    """The rows of the import picture in docs/layout.md, top row first; a continuation line (8 spaces) joins
    the row above. Names as the page writes them: 'fast/engine', 'fast' (fast/__init__.py), '__init__'."""
    text = page.read_text(encoding="utf-8")
    start = text.index("Imports go one way, down:")
    end = text.find("\n## ", start)
    block = text[text.index("\n\n    ", start) + 2:end if end >= 0 else len(text)]
    rows = []
    for line in block.rstrip("\n").split("\n"):
        if line.startswith("        "):
            rows[-1] += line.split()
        elif line.startswith("    "):
            rows.append(line.split())
    return rows


def picture_name(module: str) -> str:
    """'nanoeuler.fast.engine' -> 'fast/engine'; the package itself -> '__init__'."""
    return "__init__" if module == "nanoeuler" else module.removeprefix("nanoeuler.").replace(".", "/")


def picture(graph: dict[str, set[str]], width: int = 112) -> str:
    """The picture of a circle-free graph: each module on the row of its longest chain of imports (modules
    importing nothing of the package on the last row), names sorted, rows wrapped at width."""
    height: dict[str, int] = {}

    def h(m):
        if m not in height:
            height[m] = 1 + max((h(t) for t in graph[m]), default=-1)
        return height[m]
    top = max(h(m) for m in graph)
    rows = [sorted(picture_name(m) for m in graph if h(m) == r) for r in range(top, -1, -1)]
    lines = []
    for row in rows:
        line = "    " + row[0]
        for name in row[1:]:
            if len(line) + 2 + len(name) > width:
                lines.append(line)
                line = "        " + name
            else:
                line += "  " + name
        lines.append(line)
    return "\n".join(lines)


def test_the_layout_picture_is_the_import_graph():
    graph = import_graph()
    rows = picture_layers()
    row_of = {name: r for r, row in enumerate(rows) for name in row}
    assert sum(map(len, rows)) == len(row_of), "a module stands twice in docs/layout.md's picture"
    assert set(row_of) == {picture_name(m) for m in graph}, \
        "docs/layout.md's picture and the package differ (python tests/test_imports.py prints the package's)"
    for module, targets in graph.items():
        for t in targets:
            assert row_of[picture_name(module)] < row_of[picture_name(t)], f"{module} imports {t}, not below it"


def test_the_printed_picture_passes_the_check(tmp_path):
    page = tmp_path / "layout.md"
    page.write_text("Imports go one way, down: ...\n\n" + picture(import_graph()) + "\n")
    rows, graph = picture_layers(page), import_graph()
    row_of = {name: r for r, row in enumerate(rows) for name in row}
    assert set(row_of) == {picture_name(m) for m in graph}
    assert all(row_of[picture_name(m)] < row_of[picture_name(t)] for m, ts in graph.items() for t in ts)


def test_only_the_commands_import_training():
    """training/ is the pipeline's stages, above the model, its engines, inference, serving and interop: of
    the rest of the package only the commands (cli/) and the GPU check (gpu/check.py, on check.py's rows)
    import it."""
    above = ("nanoeuler.training", "nanoeuler.cli", "nanoeuler.gpu.check")
    graph = import_graph()
    assert "nanoeuler.training.train" in graph["nanoeuler.cli.train"]  # the graph was read
    wrong = sorted(f"{m} imports {t}" for m, ts in graph.items() for t in ts
                   if t.startswith("nanoeuler.training") and not m.startswith(above))
    assert not wrong, wrong


def test_no_benchmark_script_takes_the_name_of_a_module():
    """A test that puts bench/ on sys.path (to import a script's helper) must not shadow a module: a
    bench/llama_cpp.py once made `import llama_cpp` find the script, so the llama.cpp tests of a fresh venv
    (without llama-cpp-python, whose tests skip) failed instead. No script is named as a standard-library
    module, an installed one, or an optional package the project imports."""
    import sys
    from importlib.machinery import PathFinder
    bench = ROOT.parent / "bench"
    path = [p for p in sys.path if Path(p or ".").resolve() != bench]   # (sys.modules may hold a script a test imported)
    optional = {"llama_cpp", "gguf", "torch", "transformers", "peft", "cupy", "mpi4py", "fastapi", "uvicorn",
                "httptools", "openai", "playwright", "httpx", "numba", "matplotlib", "jinja2", "hypothesis"}
    taken = [p.stem for p in bench.glob("*.py") if p.stem in optional | set(sys.stdlib_module_names)
             or PathFinder.find_spec(p.stem, path) is not None]
    assert not taken, f"bench scripts named as modules: {taken}"


if __name__ == "__main__":
    print(picture(import_graph()))
