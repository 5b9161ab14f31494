"""Every plug-in point of usaf is a `Registry` checked against its Protocol: found here by reading the package's
modules (a registry added later is covered without listing it), each built-in plug-in has its kind's members, an
object missing one member is refused in one line that names it, and a registry's rules hold for what comes later."""

import ast
import importlib
import types
from pathlib import Path

import pytest

import usaf
from usaf.engine.sparse_weights import FORWARDS
from usaf.model.targets import TargetKind
from usaf.registry import TARGET_KINDS, Registry, protocol_members

SRC = Path(usaf.__file__).parent


def registry_names() -> list[tuple[str, str]]:
    """(module, name) of every module-level `NAME = Registry(...)` / `NAME: ... = Registry(...)` in usaf."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Registry":
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [(module, t.id) for t in targets]
    return found


REGISTRIES = registry_names()


def registry(module: str, name: str) -> Registry:
    found = getattr(importlib.import_module(module), name)
    assert isinstance(found, Registry)
    return found


def test_every_plugin_point_is_found():
    names = {name for _, name in REGISTRIES}
    assert {"STRATEGIES", "SCORERS", "TARGET_KINDS", "TRACKERS", "FORMATS", "PUBLISHED", "FORWARDS"} <= names
    assert "COMMANDS" in names


@pytest.mark.parametrize("module,name", REGISTRIES)
def test_each_builtin_plugin_has_its_kinds_members(module, name):
    plugins = registry(module, name)
    members = protocol_members(plugins.protocol)
    assert len(plugins) and members
    for key, plugin in plugins.items():
        assert isinstance(plugin, plugins.protocol), key
        assert all(hasattr(plugin, m) for m in members), key
        assert plugins.key(plugin) == key


def missing_one() -> list[tuple[str, str, str]]:
    return [
        (module, name, member)
        for module, name in REGISTRIES
        for member in protocol_members(registry(module, name).protocol)
    ]


@pytest.mark.parametrize("module,name,member", missing_one())
def test_a_plugin_missing_a_member_is_refused_in_one_line_naming_it(module, name, member):
    plugins = registry(module, name)
    _, builtin = plugins.items()[0]
    members = protocol_members(plugins.protocol)
    stand_in = types.SimpleNamespace(**{m: getattr(builtin, m) for m in members if m != member})
    stand_in.__name__ = "stand_in"  # what a command's name is read from
    with pytest.raises(usaf.UsafError) as raised:
        plugins.register(stand_in)
    said = str(raised.value)
    assert f"lacks {member} " in said and "\n" not in said
    assert "stand_in" not in plugins


def test_a_target_kind_without_a_forward_is_refused_when_registered():
    claims = TARGET_KINDS["norms"].claims
    with pytest.raises(
        usaf.UsafError, match="kind 'conv', which no sparse forward is registered as; known: linear"
    ):
        TARGET_KINDS.register(TargetKind("conv_test", "conv", claims))
    assert "conv_test" not in TARGET_KINDS
    assert list(FORWARDS) == ["linear", "rows", "vector"]


def test_setitem_registers_for_a_while(monkeypatch):
    claims = TARGET_KINDS["norms"].claims
    role = TargetKind("for_a_while_test", "vector", claims)
    with monkeypatch.context() as patch:
        patch.setitem(TARGET_KINDS, role.name, role)
        assert TARGET_KINDS[role.name] is role
    assert role.name not in TARGET_KINDS
    with pytest.raises(usaf.UsafError, match="cannot be registered as 'other'"):
        TARGET_KINDS["other"] = role
