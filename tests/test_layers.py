"""The package's layers, kept by a test: every import in appliance/ (lazy ones inside functions
included) goes down the layer list below or stays in its own package, and no modules import each
other in a circle. docs/architecture.md shows the same list.

A package imports only from its own package or from packages on lower lines; packages on one
line are peers and never import each other. The walk is over the source (ast), so it sees the
imports a test run would never execute.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import appliance

#: top to bottom; each line's packages (or top-level modules) are peers
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("cli",),
    ("run", "bench"),
    ("adapter", "plan"),
    ("actors", "cluster"),
    ("config",),
    ("engine", "data", "metrics", "tracking"),
    ("models", "quant"),
    ("storage", "hardware"),
    ("interrupt",),
    ("errors", "quiet"),
)

#: modules whose import would make `import appliance.<package>` heavy
HEAVY = (
    "ray",
    "boto3",
    "botocore",
    "triton",
    "transformers",
    "pynvml",
    "mlflow",
    "wandb",
    "tensorboard",
    "trackio",
)


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    where: str  # path:line


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every .py under the package at `root` (plus C extensions,
    which are modules too: `_quantize.c` builds `<package>._quantize`)."""
    out = {}
    for path in sorted(root.rglob("*.py")) + sorted(root.rglob("*.c")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def edges(root: Path) -> list[Edge]:
    """Every import of one of the package's own modules, as (importer, imported) edges."""
    mods = modules(root)
    top = root.name
    found = []
    for name, path in mods.items():
        if path.suffix != ".py":
            continue
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from pkg import sub` imports the submodule; `from mod import name`, mod
                targets = [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module
                    for a in node.names
                ]
            for target in targets:
                if not (target == top or target.startswith(top + ".")):
                    continue
                while target not in mods:  # `import pkg.mod.attr`: the module part
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    found.append(Edge(name, target, f"{path}:{node.lineno}"))
    return found


def package_of(module: str) -> str | None:
    """`appliance.run.driver` → "run"; `appliance.config` → "config"; the root → None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_problems(root: Path, layers=LAYERS) -> list[str]:
    """An import that goes up or sideways, or from a package the layer list does not name."""
    rank = {pkg: i for i, line in enumerate(layers) for pkg in line}
    problems = []
    for e in edges(root):
        a, b = package_of(e.source), package_of(e.target)
        if a is None or b is None or a == b:
            continue
        for pkg in (a, b):
            if pkg not in rank:
                problems.append(f"{e.where}: {pkg} is on no line of the layer list")
        if a in rank and b in rank and rank[b] <= rank[a]:
            how = "sideways (a peer)" if rank[b] == rank[a] else "upward"
            problems.append(f"{e.where}: {e.source} imports {e.target}: {how}, {a} → {b}")
    return problems


def cycles(root: Path) -> list[list[str]]:
    """Groups of modules that import each other in a circle (Tarjan's strongly connected
    components of more than one module)."""
    graph: dict[str, set[str]] = {m: set() for m in modules(root)}
    for e in edges(root):
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


ROOT = Path(appliance.__file__).parent


def test_every_import_goes_down_the_layers() -> None:
    assert layer_problems(ROOT) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert cycles(ROOT) == []


def test_every_package_is_on_the_layer_list() -> None:
    named = {pkg for line in LAYERS for pkg in line}
    found = {package_of(m) for m in modules(ROOT)} - {None}
    assert found - named == set(), "add the new package to LAYERS (and docs/architecture.md)"


def test_importing_a_package_imports_nothing_heavy() -> None:
    """`import appliance.<package>` (what its __init__ does) loads no Ray, boto3, Triton,
    transformers or NVML: they come with the functions that use them."""
    packages = sorted({f"appliance.{p}" for line in LAYERS for p in line if p != "__main__"})
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {packages!r}:
            importlib.import_module(name)
        print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_tokenizer_worker_loads_no_torch() -> None:
    """A tokenizer worker's process imports its module (and appliance.actors' __init__ with it)
    and nothing of torch: it tokenizes and packs with numpy (actors/__init__.py's lazy names)."""
    code = "import appliance.actors.tokenize_worker, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "appliance"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_names_an_upward_import_a_sideways_one_and_a_cycle(tmp_path) -> None:
    """The checks themselves, on a planted package: storage importing run (upward, lazily
    inside a function), actors importing cluster (a peer), and two modules of data importing
    each other."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "run/__init__.py": "",
            "run/driver.py": "x = 1\n",
            "storage/__init__.py": "",
            "storage/uri.py": "def f():\n    from appliance.run.driver import x\n",
            "actors/__init__.py": "",
            "actors/trainer.py": "from ..cluster import start\n",
            "cluster/__init__.py": "",
            "cluster/start.py": "",
            "data/__init__.py": "",
            "data/a.py": "from . import b\n",
            "data/b.py": "from .a import thing\n",
        },
    )
    problems = layer_problems(root)
    assert len(problems) == 2, problems
    assert (
        "storage/uri.py:2: appliance.storage.uri imports appliance.run.driver: upward"
        in problems[1]
    )
    assert "actors/trainer.py:1: appliance.actors.trainer imports appliance.cluster.start: " \
        "sideways" in problems[0]  # fmt: skip
    assert cycles(root) == [["appliance.data.a", "appliance.data.b"]]


def test_no_package_exports_a_name_that_hides_one_of_its_modules() -> None:
    """`from appliance.storage import localize` must give the module, as the code and the tests
    write it: a package that exported a function `localize` from storage/localize.py would hand
    out the function instead (its __init__ rebinds the name after the submodule is imported)."""
    import importlib

    hidden = []
    for pkg in sorted({p for line in LAYERS for p in line if (ROOT / p).is_dir()}):
        package = importlib.import_module(f"appliance.{pkg}")
        for name in getattr(package, "__all__", []):
            value = getattr(package, name, None)  # (a module __all__ names may not be loaded)
            is_module = isinstance(value, type(package))
            if (ROOT / pkg / f"{name}.py").is_file() and value is not None and not is_module:
                hidden.append(f"appliance.{pkg}.{name}")
    assert hidden == []
