"""The package's layers and the one-way arrows between them, read from the source (every import, lazy ones too).

From the bottom (docs/architecture.md draws the same):

    numerics/                            datatypes, affine, outliers, quantizer, turbo, packing, rope
    storage  recipe  shape  config       bytes held, calibrated statistics, model shapes, defaults
    methods/   kernels/                  names, registry and budgets | decode attention over a store's view
    cache/                               the store (reads the kernels' view type, builds with the registry)
    paged/   integrations/               pages for a serving engine | transformers' side
    serving/  calibrate/  eval/
    cli

A module imports its own group and the rows below it only; only `integrations/`, `calibrate/`, `eval/`,
the CLI and vLLM's backend may import transformers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvsqueeze

ROOT = Path(kvsqueeze.__file__).parent
LAYERS = [("numerics",), ("storage", "recipe", "shape", "config", "numba_cache"), ("methods", "kernels"), ("cache",),
          ("paged", "integrations"), ("serving", "calibrate", "eval"), ("cli",)]
RANK = {group: i for i, row in enumerate(LAYERS) for group in row}
NUMERICS = {"numerics", "storage", "recipe", "shape", "config", "numba_cache", "methods"}  # what neither cache nor kernels are


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _imports(path: Path) -> set[str]:
    """Modules `path` imports anywhere (kvsqueeze-relative names such as 'cache.store', or top-level
    packages such as 'transformers')."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                mod = node.module or ""
                out.add(mod[len("kvsqueeze."):] if mod.startswith("kvsqueeze.") else mod)
                continue
            base = package[: len(package) - node.level + 1]
            target = ".".join([*base, node.module] if node.module else base)
            out.add(target)
            out |= {f"{target}.{a.name}" if target else a.name for a in node.names}  # `from . import x`
    return out


def _graph() -> dict[str, set[str]]:
    mods = {_module_name(p): p for p in ROOT.rglob("*.py")}
    mods.pop("", None)
    graph = {}
    for name, path in mods.items():
        graph[name] = {m for m in _imports(path) if m in mods and m != name}
    return graph


def _external(name: str) -> set[str]:
    path = next(p for p in ROOT.rglob("*.py") if _module_name(p) == name)
    return {m.split(".")[0] for m in _imports(path)}


def _lower(name: str) -> bool:
    """The numerics and methods, the cache store and the kernels: the layers that must not know transformers."""
    top = name.split(".")[0]
    return top in NUMERICS or top in ("cache", "kernels")


def test_every_module_belongs_to_a_layer_and_imports_only_its_own_group_and_the_rows_below():
    graph = _graph()
    for name, deps in graph.items():
        group = name.split(".")[0]
        assert group in RANK, f"kvsqueeze.{name} is in no layer of LAYERS: add its group to the layout"
        for dep in deps:
            other = dep.split(".")[0]
            assert other == group or RANK[other] < RANK[group], (
                f"kvsqueeze.{name} imports kvsqueeze.{dep}: {other} is not below {group}")


def test_the_numerics_know_nothing_above_them():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("numerics"):
            assert all(d.startswith("numerics") for d in deps), f"kvsqueeze.{name} imports {sorted(deps)}"


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            # a package's __init__ importing its own submodules is how a package exports them, not a cycle
            if m and n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_lower_layers_do_not_import_transformers_or_upper_layers():
    graph = _graph()
    for name in graph:
        if not _lower(name):
            continue
        assert "transformers" not in _external(name), f"kvsqueeze.{name} imports transformers"
        upper = [m for m in graph[name] if not _lower(m)]
        assert not upper, f"kvsqueeze.{name} imports {upper}, a layer above it"


def test_numerics_do_not_import_the_cache_or_the_kernels():
    graph = _graph()
    for name in graph:
        if name.split(".")[0] in NUMERICS:
            below = [m for m in graph[name] if m.split(".")[0] in ("cache", "kernels")]
            assert not below, f"kvsqueeze.{name} imports {below}"


def test_the_kernels_do_not_import_the_cache():
    graph = _graph()
    for name in graph:
        if name.startswith("kernels"):
            assert not [m for m in graph[name] if m.startswith("cache")], f"kvsqueeze.{name} reads the cache"


def test_the_serving_side_stands_on_the_lower_layers_alone():
    """What a serving engine's process imports (the paged layout, the settings, the vLLM backend) reads recipes,
    stores and kernels, never `integrations/`, `calibrate/`, `eval/` or the CLI, and imports transformers only
    where vLLM's own one computes a rescaled RoPE."""
    graph = _graph()
    for name in graph:
        if name.split(".")[0] not in ("paged", "serving"):
            continue
        upper = [m for m in graph[name] if not (_lower(m) or m.split(".")[0] in ("paged", "serving"))]
        assert not upper, f"kvsqueeze.{name} imports {upper}"
        if name != "serving.vllm":
            assert "transformers" not in _external(name), f"kvsqueeze.{name} imports transformers"


def test_a_layer_s_pages_are_built_without_transformers(tiny_recipe_dir):
    import subprocess
    import sys

    code = ("import sys; sys.modules['transformers'] = None\n"
            "from kvsqueeze.serving.settings import ServingConfig\n"
            f"c = ServingConfig({str(tiny_recipe_dir)!r}, 'nuq3-1%')\n"
            "lay = c.layout(1, 32, 16, 16)\n"
            "print(lay.page_bytes, c.spec.name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == "nuq3-1%:kslots1"  # 1% of the tiny model's 32 channels: one slot
