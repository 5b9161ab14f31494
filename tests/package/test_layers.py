"""The package's house rules, read from the source: stage packages import only earlier stages, no import cycles
(imports inside functions included), and transformers' private names only in the one module that adapts it."""

import ast
import re
from pathlib import Path

import pytest
import torch
import transformers

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
    ["usaf.demo"],
    ["usaf", "usaf.startup", "usaf.cli", "usaf.commands", "usaf.__main__"],
]
# where an import inside a function is fine: the command line defers its commands to start fast
DEFERRED_ALLOWED = ("usaf.cli", "usaf.commands")
TRANSFORMERS_ADAPTER = "usaf.model.hf"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = SRC) -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted((root / "usaf").rglob("*.py"))}


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


def test_every_module_is_placed_in_a_stage():
    """Modules that import nothing of usaf too (a new package must be placed in the pipeline to be checked)."""
    unplaced = []
    for name in modules():
        try:
            stage_of(name)
        except AssertionError:
            unplaced.append(name)
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
    global SRC
    saved, SRC = SRC, tmp_path
    try:
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
    finally:
        SRC = saved


# ---- transformers' private API ----------------------------------------------------------------------------------

TRANSFORMERS_DIR = Path(transformers.__file__).parent


def _transformers_private_names(candidates: set[str]) -> set[str]:
    """Which of `candidates` (attribute names with a leading underscore) transformers itself defines or uses, less
    torch's own (a module's `_buffers`, a scheduler's `_last_lr`: torch's API, not transformers')."""
    param = torch.nn.Parameter(torch.zeros(1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([param]), lambda step: 1.0)
    torch_owned = {*dir(torch.nn.Module()), *dir(param), *dir(scheduler)}
    candidates = candidates - torch_owned
    found = set()
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, candidates))) + r")\b")
    for path in [*TRANSFORMERS_DIR.glob("*.py"), *(TRANSFORMERS_DIR / "integrations").glob("*.py")]:
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


def test_transformers_internals_only_in_the_adapter():
    trees = modules()
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
    private = _transformers_private_names(
        {n for found in uses.values() for n in found if not n.startswith("line")}
    )
    outside = {
        name: [use for use in found if use.startswith("line") or use in private]
        for name, found in uses.items()
        if name != TRANSFORMERS_ADAPTER
    }
    assert {name: found for name, found in outside.items() if found} == {}


@pytest.mark.parametrize("name", ["usaf.engine.sparse", "usaf.train.loop", "usaf.model.hf"])
def test_every_module_belongs_to_a_stage(name):
    assert name in modules() and stage_of(name) >= 0
