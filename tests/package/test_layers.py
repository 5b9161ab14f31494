"""The package's house rules, read from the source: stage packages import only earlier stages, no import cycles
(imports inside functions included), and transformers' private names only in the one module that adapts it."""

import ast
import functools
import re
from pathlib import Path

import pytest
import torch
import transformers

from usaf.model import hf_guard

SRC = Path(__file__).resolve().parents[2] / "src"

# The pipeline, in order: a module may import its own stage and the stages above it, never one below.
STAGES = [
    ["usaf.version", "usaf.errors", "usaf.files", "usaf.registry"],
    ["usaf.quant"],  # before the config: `model.quant`'s choices are the formats' registry
    ["usaf.config"],
    ["usaf.kernels"],
    ["usaf.store"],
    ["usaf.model"],
    ["usaf.io"],
    ["usaf.engine"],
    ["usaf.selection"],
    ["usaf.prepare"],
    ["usaf.base"],
    ["usaf.planner"],
    ["usaf.report"],
    ["usaf.data"],
    ["usaf.train"],
    ["usaf.export"],
    ["usaf.generate"],
    ["usaf.testing"],
    ["usaf.simulate"],  # the simulated step: the train loop's pieces and the planner, on fake tensors
    ["usaf.demo"],
    ["usaf", "usaf.api", "usaf.startup", "usaf.cli", "usaf.commands", "usaf.__main__"],
]
# where an import inside a function is fine: the command line defers its commands to start fast
DEFERRED_ALLOWED = ("usaf.cli", "usaf.commands")
# the adapter, and the table of the private names it relies on (checked at import)
TRANSFORMERS_ADAPTER = ("usaf.model.hf", "usaf.model.hf_guard")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # parsed once for the tests of this file (none changes the trees)
def modules(root: Path = SRC) -> dict[str, ast.Module]:
    return {
        module_name(p, root): ast.parse(p.read_text(), str(p)) for p in sorted((root / "usaf").rglob("*.py"))
    }


def usaf_imports(name: str, tree: ast.Module, known) -> list[tuple[str, bool, int]]:
    """(imported usaf module, at module level?, line) for every import in `tree`."""
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}:{node.lineno}: a relative import; usaf imports absolutely"
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            ]
        else:
            continue
        found += [(t, id(node) in top, node.lineno) for t in targets if t == "usaf" or t.startswith("usaf.")]
    return found


def stage_of(name: str) -> int:
    best = None
    for index, stage in enumerate(STAGES):
        for prefix in stage:
            if name == prefix or (prefix != "usaf" and name.startswith(prefix + ".")):
                best = index
    assert best is not None, f"{name} belongs to no stage: add it to STAGES in tests/package/test_layers.py"
    return best


def import_graph(trees: dict[str, ast.Module]) -> dict[str, dict[str, int]]:
    return {
        name: {target: line for target, _, line in usaf_imports(name, tree, trees) if target != name}
        for name, tree in trees.items()
    }


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def order_violations(trees: dict[str, ast.Module]) -> list[str]:
    bad = []
    for name, tree in trees.items():
        for target, at_top, line in usaf_imports(name, tree, trees):
            if target == "usaf" and name != "usaf":
                bad.append(
                    f"{name}:{line} imports the package root (the public API); import the module itself"
                )
            elif stage_of(target) > stage_of(name):
                bad.append(f"{name}:{line} imports {target}, a later stage")
            if not at_top and not name.startswith(DEFERRED_ALLOWED):
                bad.append(f"{name}:{line} imports {target} inside a function")
    return bad


def _placed(name: str) -> bool:
    try:
        stage_of(name)
    except AssertionError:
        return False
    return True


def test_every_module_is_placed_in_a_stage():
    """Modules that import nothing of usaf too (a new package must be placed in the pipeline to be checked)."""
    unplaced = [name for name in modules() if not _placed(name)]
    assert unplaced == [], f"{unplaced} belong to no stage: add them to STAGES"


def test_stages_import_only_earlier_stages():
    assert order_violations(modules()) == []


def test_no_import_cycles_counting_imports_inside_functions():
    assert find_cycle(import_graph(modules())) is None


def test_the_rules_catch_a_cycle_and_an_import_against_the_order(tmp_path):
    """The checks above fail when broken on purpose: the engine importing the training loop back."""
    (tmp_path / "usaf" / "engine").mkdir(parents=True)
    for name in ("__init__", "engine/__init__"):
        (tmp_path / "usaf" / f"{name}.py").write_text("")
    (tmp_path / "usaf" / "train").mkdir()
    (tmp_path / "usaf" / "train" / "__init__.py").write_text("")
    (tmp_path / "usaf" / "engine" / "sparse.py").write_text(
        "def f():\n    from usaf.train.loop import train\n"
    )
    (tmp_path / "usaf" / "train" / "loop.py").write_text("from usaf.engine.sparse import f\n")
    trees = modules(tmp_path)
    assert find_cycle(import_graph(trees)) == [
        "usaf.engine.sparse",
        "usaf.train.loop",
        "usaf.engine.sparse",
    ]
    assert order_violations(trees) == [
        "usaf.engine.sparse:2 imports usaf.train.loop, a later stage",
        "usaf.engine.sparse:2 imports usaf.train.loop inside a function",
    ]


# ---- transformers' private API ----------------------------------------------------------------------------------

TRANSFORMERS_DIR = Path(transformers.__file__).parent
# where transformers defines what usaf touches: its top level, integrations (the experts registry), utils (the
# chat-template compiler)
TRANSFORMERS_SOURCES = [TRANSFORMERS_DIR / d for d in ("", "integrations", "utils")]
# torch's private API that usaf relies on beyond nn.Module's own: DDP's ignore list
DDP_SOURCE = Path(torch.nn.parallel.distributed.__file__)


def _library_private_names(candidates: set[str], paths: list[Path]) -> set[str]:
    """Which of `candidates` (attribute names with a leading underscore) the library files `paths` (folders: their
    .py files) define or use, less torch's own (`torch._foreach_add_`, a module's `_buffers`, a scheduler's
    `_last_lr`: torch's API)."""
    param = torch.nn.Parameter(torch.zeros(1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([param]), lambda step: 1.0)
    torch_owned = {*dir(torch), *dir(torch.nn.Module()), *dir(param), *dir(scheduler)}
    candidates = candidates - torch_owned
    if not candidates:
        return set()
    found = set()
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, candidates))) + r")\b")
    for path in [f for p in paths for f in (sorted(p.glob("*.py")) if p.is_dir() else [p])]:
        found |= set(pattern.findall(path.read_text(errors="ignore")))
    return found


def _own_names(trees) -> set[str]:
    """Names usaf defines itself: functions, classes, attributes it assigns."""
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
    return own


def _uses_of_libraries(trees) -> dict[str, list[str]]:
    """Per module: its imports of transformers' submodules ('line N: ...') and the attributes with one leading
    underscore it reads or writes that usaf does not define itself."""
    own = _own_names(trees)
    uses: dict[str, list[str]] = {}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformers."):
                uses.setdefault(name, []).append(f"line {node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                uses.setdefault(name, []).extend(
                    f"line {node.lineno}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("transformers.")
                )
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ) and node.attr not in own:
                uses.setdefault(name, []).append(node.attr)
    return uses


def _private_attributes(uses: dict[str, list[str]]) -> set[str]:
    return {n for found in uses.values() for n in found if not n.startswith("line")}


def test_transformers_internals_only_in_the_adapter():
    uses = _uses_of_libraries(modules())
    private = _library_private_names(_private_attributes(uses), TRANSFORMERS_SOURCES)
    outside = {
        name: [use for use in found if use.startswith("line") or use in private]
        for name, found in uses.items()
        if name not in TRANSFORMERS_ADAPTER
    }
    assert {name: found for name, found in outside.items() if found} == {}


def unguarded_and_stale(trees) -> tuple[set[str], set[str]]:
    """(private names of transformers and DDP that the source uses without a row in usaf.model.hf_guard's table,
    rows whose name the source no longer uses)."""
    used = _private_attributes(_uses_of_libraries(trees))
    private = _library_private_names(used, [*TRANSFORMERS_SOURCES, DDP_SOURCE])
    guarded = {internal.attr for internal in hf_guard.INTERNALS}
    return private - guarded, guarded - used


def test_every_private_name_usaf_uses_is_checked_at_import():
    assert unguarded_and_stale(modules()) == (set(), set())


def test_an_unguarded_private_name_is_found(tmp_path):
    """The check above fails when broken on purpose: a module reading transformers' `_attn_implementation_internal`
    (no row in the table)."""
    (tmp_path / "usaf" / "model").mkdir(parents=True)
    (tmp_path / "usaf" / "model" / "hf.py").write_text(
        "def attention(config):\n    return config._attn_implementation_internal\n"
    )
    unguarded, stale = unguarded_and_stale(modules(tmp_path))
    assert unguarded == {"_attn_implementation_internal"}
    assert stale == {internal.attr for internal in hf_guard.INTERNALS}


# ---- every module in the map ------------------------------------------------------------------------------------


def test_every_stage_entry_names_a_module():
    """A stage entry that names no module (renamed, removed) would place nothing and hide the move."""
    names = set(modules())
    assert [prefix for stage in STAGES for prefix in stage if prefix not in names] == []


def test_a_module_outside_the_map_is_named(tmp_path):
    """A new package no stage names fails the map check, by name."""
    (tmp_path / "usaf" / "newpart").mkdir(parents=True)
    for name in ("__init__", "version", "newpart/__init__", "newpart/thing"):
        (tmp_path / "usaf" / f"{name}.py").write_text("")
    unplaced = [name for name in modules(tmp_path) if not _placed(name)]
    assert unplaced == ["usaf.newpart", "usaf.newpart.thing"]
    with pytest.raises(AssertionError, match=r"usaf\.newpart\.thing belongs to no stage"):
        stage_of("usaf.newpart.thing")
