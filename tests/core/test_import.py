"""`import mpsboost` stays light (neither diffusers nor transformers), and the package keeps its layers:
the gate (a package) and patching are leaves, ops import only errors (the exception classes), recipes never
the API, no import cycle."""

from __future__ import annotations

import functools
import subprocess
import sys


def test_import_does_not_pull_in_diffusers_or_transformers():
    code = (
        "import sys, mpsboost\n"
        "mpsboost.recipe_names()\n"  # loads every built-in recipe module too
        "import mpsboost.gate, mpsboost.report, mpsboost.api, mpsboost.cli\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('diffusers', 'transformers', 'accelerate'))\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"import mpsboost imported: {proc.stdout.strip()}"


def test_public_api_is_exported():
    import mpsboost

    for name in ("patch", "unpatch", "patched", "plan", "last_report", "save_fp8", "load_fp8", "Env", "PatchReport"):
        assert callable(getattr(mpsboost, name)) or isinstance(getattr(mpsboost, name), type), name


def test_ops_hold_tensor_functions_only():
    """ops/ is the shared kernel layer (its package docstring says the same): of mpsboost it imports only
    errors, the exception classes (_MAY_IMPORT["ops"]; not the gate: which path a layer takes is the recipes'
    policy; no registry, patching, recipe or API module), and it names no diffusers or transformers module (the
    integrations live next to their recipes)."""
    import ast
    from pathlib import Path

    import mpsboost.ops

    allowed = _MAY_IMPORT["ops"]
    assert allowed == {"errors"}
    offenders = []
    for path in sorted(Path(mpsboost.ops.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                parts = (node.module or "").split(".")
                if node.level >= 2 and node.module is not None and parts[0] not in allowed:
                    offenders.append(f"{path.name}: from {'.' * node.level}{node.module} import ...")
                if node.level >= 2 and node.module is None:
                    offenders += [
                        f"{path.name}: from {'.' * node.level} import {a.name}"
                        for a in node.names
                        if a.name not in allowed
                    ]
                if node.level == 0 and parts[0] in ("diffusers", "transformers", "mpsboost"):
                    offenders.append(f"{path.name}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                offenders += [
                    f"{path.name}: import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] in ("diffusers", "transformers")
                ]
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith(("diffusers.", "transformers."))
            ):
                offenders.append(f"{path.name}: names {node.value!r}")
    assert not offenders, offenders


def _import_graph() -> dict[str, set[str]]:
    """{module: modules it imports} over src/mpsboost, module-level and function-level imports alike
    (every ``import`` / ``from ... import`` statement anywhere in the file), internal modules only: a fresh copy
    each call of the graph parsed once per process."""
    return {k: set(v) for k, v in _parsed_import_graph().items()}


@functools.lru_cache(maxsize=1)
def _parsed_import_graph() -> dict[str, frozenset[str]]:
    import ast
    from pathlib import Path

    import mpsboost

    root = Path(mpsboost.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        names[".".join(parts)] = (path, is_pkg)
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in names.items():
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = base[: len(base) - (node.level - 1)]
                    head = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    head = node.module or ""
                # "from . import x" and "from .pkg import mod" name modules; then the package is only their parent
                subs = [f"{head}.{a.name}" for a in node.names if f"{head}.{a.name}" in names]
                targets = subs or [head]
            for t in targets:
                # A package that holds the module is imported before it anyway: not an edge of its own.
                if t in names and t != mod and not mod.startswith(t + "."):
                    deps.add(t)
        graph[mod] = deps
    return {k: frozenset(v) for k, v in graph.items()}


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path of imports from ``start`` to ``goal``, or None."""
    stack, seen = [(start, [start])], {start}
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == goal:
                return path + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_import_graph_has_no_fp8_io_recipe_cycle():
    graph = _import_graph()
    io, recipe = "mpsboost.checkpoints", "mpsboost.recipes.fp8.recipe"
    assert io in graph and recipe in graph and "mpsboost.recipes.fp8.layers" in graph[recipe]
    assert recipe not in graph[io] and io not in graph[recipe]
    for a, b in (
        (io, recipe),
        (recipe, io),
        ("mpsboost.recipes.fp8.formats", recipe),
        ("mpsboost.quant.fp8_plan", recipe),
    ):
        path = _reaches(graph, a, b)
        back = _reaches(graph, b, a)
        assert path is None or back is None, f"import cycle: {' -> '.join(path)} and back {' -> '.join(back or [])}"
    # The recipe reaches neither the fp8 file code nor the API at all.
    assert _reaches(graph, recipe, io) is None
    assert _reaches(graph, recipe, "mpsboost.api") is None


def test_import_graph_ops_stay_below_registry_and_recipes():
    graph = _import_graph()
    ops = [m for m in graph if m.startswith("mpsboost.ops.")]
    assert len(ops) >= 10
    offenders = [
        f"{m} -> {d}"
        for m in ops
        for d in graph[m]
        if d == "mpsboost.registry"
        or d == "mpsboost.recipes"
        or d.startswith("mpsboost.recipes.")
        or d in ("mpsboost.api", "mpsboost.checkpoints", "mpsboost.recipes.fp8.formats")
    ]
    assert not offenders, offenders
    # The shared fp8 helpers are neutral too: neither registry nor recipes.
    assert not (
        graph["mpsboost.recipes.fp8.layers"] & {"mpsboost.registry", "mpsboost.recipes", "mpsboost.checkpoints"}
    )


def test_import_graph_sees_function_level_imports():
    """The graph would have missed the old cycle: fp8_io imported the recipe inside functions."""
    graph = _import_graph()
    assert "mpsboost.api" in graph["mpsboost.checkpoints"]  # only imported inside functions there


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as one import path round it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # the package has ~100 modules: recursion depth is no concern
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        a = group[0]
        b = next(d for d in sorted(graph[a]) if d in group)
        out.append([a] + (_reaches(graph, b, a) or [b, a]))
    return out


def test_import_graph_of_the_whole_package_has_no_cycle():
    """Every module of src/mpsboost, imports inside functions included: no module reaches itself again.
    (It caught mpsboost.checkpoints -> mpsboost.recipes.fp8.formats -> mpsboost.checkpoints: fp8_formats imported the
    safetensors header reader from fp8_io; the reader now lives in fp8_formats, a leaf of the fp8 code.)"""
    graph = _import_graph()
    assert len(graph) >= 40 and "mpsboost.recipes.fp8.formats" in graph and "mpsboost.bench" in graph
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_sees_a_cycle_through_function_level_imports():
    """The check above could pass by seeing nothing: on a graph with the old fp8 cycle put back it fails."""
    graph = {k: set(v) for k, v in _import_graph().items()}
    graph["mpsboost.quant.fp8_plan"].add("mpsboost.checkpoints")
    assert "mpsboost.quant.fp8_plan" in graph["mpsboost.checkpoints"]  # checkpoints imports it inside functions
    cycles = _cycles(graph)
    assert len(cycles) == 1 and set(cycles[0]) == {"mpsboost.checkpoints", "mpsboost.quant.fp8_plan"}
    assert not _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) and _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}})


# ------------------------------------------------------------------------------------------ layering


def _group(mod: str) -> str:
    """The layer a module belongs to: its subpackage (``ops``, ``recipes``, ``bench``, ``selftest``) or
    its own name (``gate``, ``registry``, ``api``, ...); the package itself is ``mpsboost``."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


# What each lower layer may import of mpsboost besides itself. Layers not named here (api, checkpoints,
# cli, demo, docs, selftest, the package) sit on top and may import any of these.
_MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    # The gate is a leaf: the version and capability table every layer asks, asking nothing of mpsboost.
    # It is the package mpsboost.gate (env, rules, probes, features): its modules import each other only.
    "gate": {"errors"},
    # The patch primitive and the per-module store: a leaf too (nothing above it can reach a module's state).
    "patching": set(),
    "tuning": {"errors", "gate"},
    # ondevice: the patch-time choice a real Mac makes by timing; it asks the gate only.
    "ondevice": {"errors", "gate"},
    "report": {"errors", "gate"},
    # ops: tensor functions, deciding nothing: the paths a layer may take arrive as arguments, chosen by the
    # recipes from the gate, the tuning files and the Mac's timings. Of mpsboost only the exception classes.
    "ops": {"errors"},
    # registry imports the package mpsboost.recipes (see _EXACT) to register the built-in recipes lazily.
    "registry": {"errors", "gate", "patching"},
    # recipes: never the API, checkpoints, bench or the command line; each other only within recipes/.
    "recipes": {"errors", "gate", "tuning", "ondevice", "ops", "patching", "registry"},
    # bench measures; it lists the recipe names (bench.cli) through the registry and imports no recipe,
    # no API. (Its functions also `import mpsboost` for the package's version and location: the package
    # is imported before any of its submodules anyway, so the graph does not count it as an edge.)
    "bench": {"errors", "gate", "registry"},
}
# Single module edges allowed beyond the table, each with why.
_EXACT = {
    ("mpsboost.registry", "mpsboost.recipes"): "all_recipes() imports the package once; each recipe registers",
    # fp8's reading code moved into the quant package; the old module re-exports it for its importers.
    ("mpsboost.recipes.fp8.formats", "mpsboost.quant.fp8_formats"): "re-exports the fp8 rows and open_checkpoint",
    ("mpsboost.recipes.fp8.formats", "mpsboost.quant.fp8_plan"): "re-exports plan_load, describe_checkpoint",
    ("mpsboost.recipes.fp8.formats", "mpsboost.quant.io"): "re-exports the one file reader (read_tensor, ...)",
}


def _layer_offences(graph: dict[str, set[str]]) -> list[str]:
    offenders = []
    for mod, deps in sorted(graph.items()):
        group = _group(mod)
        if group not in _MAY_IMPORT:
            continue
        for dep in sorted(deps):
            if _group(dep) != group and _group(dep) not in _MAY_IMPORT[group] and (mod, dep) not in _EXACT:
                offenders.append(f"{mod} -> {dep} ({group} may import {sorted(_MAY_IMPORT[group]) or 'nothing'})")
    return offenders


def test_layers_import_only_what_lies_below_them():
    graph = _import_graph()
    assert {_group(m) for m in graph} >= set(_MAY_IMPORT)
    # The gate is a package; each of its modules belongs to the layer "gate".
    gate_modules = {m for m in graph if _group(m) == "gate"}
    assert gate_modules >= {f"mpsboost.gate.{m}" for m in ("env", "rules", "probes", "features")} | {"mpsboost.gate"}
    offenders = _layer_offences(graph)
    assert not offenders, "imports against the layering:\n" + "\n".join(offenders)
    # The exceptions are live: an edge that went away leaves an entry to remove.
    assert all(dep in graph[mod] for mod, dep in _EXACT), _EXACT


def test_the_layering_check_sees_a_violation():
    """The check above could pass by seeing nothing: each of these edges put into the real graph (a recipe
    importing the API, ops the registry, the gate (any module of its package) anything, bench a recipe) is
    reported, and only it."""
    for mod, dep in (
        ("mpsboost.recipes.softmax", "mpsboost.api"),
        ("mpsboost.ops.moe", "mpsboost.registry"),
        ("mpsboost.gate", "mpsboost.tuning"),
        ("mpsboost.gate.features", "mpsboost.ops.moe"),
        ("mpsboost.gate.probes", "mpsboost.patching"),
        ("mpsboost.bench.cli", "mpsboost.recipes.softmax"),
        ("mpsboost.patching", "mpsboost.gate"),
    ):
        graph = {k: set(v) for k, v in _import_graph().items()}
        assert mod in graph and dep in graph and dep not in graph[mod]
        graph[mod].add(dep)
        found = _layer_offences(graph)
        assert len(found) == 1 and found[0].startswith(f"{mod} -> {dep} "), found


def test_recipes_never_reach_the_api():
    """Not only no direct import: no chain of imports from a recipe module reaches api or checkpoints."""
    graph = _import_graph()
    recipes = [m for m in graph if _group(m) == "recipes"]
    assert len(recipes) >= 10
    reached = [
        f"{' -> '.join(p)}"
        for m in recipes
        for goal in ("mpsboost.api", "mpsboost.checkpoints")
        if (p := _reaches(graph, m, goal))
    ]
    assert not reached, reached
