"""The house in figures: each package of src/usaf with the first sentence of its docstring (what it owns), then the
ten largest modules and functions (lines): the figures of a structural change, before and after.

    python bench/house.py [SRC]        # SRC: a checkout's src/usaf (default: this one)
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").split())
    return (text.split(". ")[0].rstrip(".") + ".") if text else "(no docstring)"


def main(src: Path) -> None:
    modules = sorted(p for p in src.rglob("*.py"))
    print(f"## Packages of {src}\n")
    for init in sorted(src.rglob("__init__.py")):
        package = init.parent.relative_to(src.parent).as_posix().replace("/", ".")
        count = len(list(init.parent.glob("*.py")))
        print(
            f"- `{package}` ({count} modules): {first_sentence(ast.get_docstring(ast.parse(init.read_text())))}"
        )
    single = [p for p in src.glob("*.py") if p.name != "__init__.py"]
    for p in sorted(single):
        print(f"- `usaf.{p.stem}` (module): {first_sentence(ast.get_docstring(ast.parse(p.read_text())))}")
    sizes = sorted((len(p.read_text().splitlines()), p.relative_to(src.parent).as_posix()) for p in modules)
    print(f"\n## Ten largest modules (lines; {len(modules)} modules, {sum(n for n, _ in sizes)} lines)\n")
    for n, name in reversed(sizes[-10:]):
        print(f"- {n:5d}  {name}")
    functions = []
    for p in modules:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append(
                    (node.end_lineno - node.lineno + 1, f"{p.relative_to(src.parent)}:{node.name}")
                )
    functions.sort()
    print("\n## Ten largest functions (lines, docstring included)\n")
    for n, name in reversed(functions[-10:]):
        print(f"- {n:5d}  {name}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "src",
        nargs="?",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "src" / "usaf",
        help="a checkout's src/usaf (default: this one)",
    )
    main(parser.parse_args().src)
