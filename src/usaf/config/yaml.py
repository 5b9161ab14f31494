"""Config files read safely: PyYAML's safe loader, with aliases bounded and duplicate keys refused."""

from __future__ import annotations

from usaf.errors import ConfigError, first_line

# ---- YAML, bounded -------------------------------------------------------------------------------------------------
# PyYAML builds an alias once and shares it, but whatever walks the result (the checks' messages, the run's
# config.yaml, a deep copy) expands it: a 475-byte "billion laughs" is 10^9 strings. A config is a few dozen
# values, so a document is refused when its expansion would exceed YAML_MAX_NODES, before anything is built. A key
# given twice would silently keep the last value (a section given twice, the last section): refused too.
YAML_MAX_NODES = 10_000


def read_yaml(stream, source: str):
    """The YAML document in `stream` (a string or a text file) as Python values: safe tags only, aliases bounded,
    no duplicate keys; any problem is one line naming `source` and the line."""
    import yaml

    loader = _bounded_loader()(stream)
    try:
        return loader.get_single_data()
    except _YamlRefused as refused:
        raise YamlRefusedError(f"{source}:{refused.line}: {refused}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = " ".join(str(err.problem or err.context or "").split())
        raise ConfigError(f"{where}: not valid YAML: {first_line(ValueError(problem))}") from None
    except (yaml.YAMLError, RecursionError) as err:
        raise ConfigError(f"{source} is not valid YAML: {first_line(err)}") from None
    finally:
        loader.dispose()


class YamlRefusedError(ConfigError):
    """A YAML document refused for its shape (aliases expanding too far, a key given twice), not its syntax."""


class _YamlRefused(Exception):
    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


_LOADER = None


def _bounded_loader():
    """yaml.SafeLoader (libyaml's when there is one) that sizes the document before building it, and refuses
    duplicate keys."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class BoundedLoader(base):
        def construct_document(self, node):
            _check_expansion(node)
            return super().construct_document(node)

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        duplicate = key in seen
                        seen.add(key)
                    except TypeError:  # a list as a key: yaml reports it below
                        continue
                    if duplicate:
                        raise _YamlRefused(
                            f"key {key!r} appears twice in the same mapping (the first would be silently "
                            "dropped); give it once",
                            key_node.start_mark.line + 1,
                        )
            return super().construct_mapping(node, deep=deep)

    _LOADER = BoundedLoader
    return _LOADER


def _check_expansion(root) -> None:
    """Refuse a node graph whose expansion (aliases copied out) has over YAML_MAX_NODES nodes, or a cycle."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:  # iterative: a deeply nested document must not overflow Python's stack
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            children = _children(node)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            open_nodes.discard(key)
            if sizes[key] > YAML_MAX_NODES:
                raise _YamlRefused(
                    f"the document's aliases (*name) expand to over {YAML_MAX_NODES:,} values; a usaf config "
                    "needs no more: write the values out, or use fewer aliases",
                    node.start_mark.line + 1,
                )
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise _YamlRefused(
                "an alias refers to a node that contains it (a cycle); aliases must not nest",
                node.start_mark.line + 1,
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


def _children(node) -> list:
    value = node.value
    if not isinstance(value, list):
        return []
    return [part for item in value for part in (item if isinstance(item, tuple) else (item,))]
