"""Chat templates rendered within bounds: a few bytes of Jinja must not cost gigabytes or minutes.

transformers renders a chat template in its immutable sandbox, which keeps a template away from Python's
internals but not from the machine's memory and time: two nested `range(99999)` loops print 10^10 characters,
`'x' * 10**10` or `'x' | center(10**10)` allocate gigabytes at once, `99 ** 99999999` computes for minutes, a
macro that calls itself recurses until the stack gives out. `rendering(origin)` is the context every usaf
rendering runs in: transformers' compiled template is replaced, for its duration, by one compiled in
`_BoundedEnvironment` (the same sandbox, filters, globals and `{% generation %}` extension), which stops a render
at the first bound it meets (`RenderBounds`) with a TemplateBoundError that names the bound:

- output: at most `max_chars` characters (1 M characters plus 8 a character of the conversation given);
- values: no string or list over `max_chars` (`*`, `+`, `~`, `%` and the growing methods and filters are
  checked before they allocate), no size argument over INT_LIMIT, no power over POWER_BITS bits;
- loops: at most MAX_ITERATIONS iterations in all, every `{% for %}` counted;
- macros nested at most MAX_DEPTH deep, and Python's RecursionError reported as such;
- time: MAX_SECONDS a render, checked at every iteration, call and output piece.
A chat template renders a conversation in milliseconds and well inside all of these.
"""

from __future__ import annotations

import contextvars
import functools
import re
import time
from contextlib import contextmanager

from jinja2 import nodes
from jinja2.environment import Template
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from usaf.model.hf import chat_template_compiler, chat_template_environment

MAX_SECONDS = 5.0
MAX_ITERATIONS = 2_000_000
MAX_DEPTH = 64
INT_LIMIT = 1_000_000  # a width, count or repeat asked of a string method, filter or global
POWER_BITS = 4096
BASE_CHARS = 1 << 20


class TemplateBoundError(Exception):
    """A render stopped at a bound: the message says which, as a phrase ("renders over ... characters")."""


class RenderBounds:
    """The budget of one render (or of a few renders that count as one)."""

    def __init__(self, input_chars: int = 0):
        self.max_chars = BASE_CHARS + 8 * input_chars
        self.deadline = time.monotonic() + MAX_SECONDS
        self.iterations = 0
        self.output = 0
        self.depth = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBoundError(f"runs over {MAX_SECONDS:g} seconds")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > MAX_ITERATIONS:
            raise TemplateBoundError(f"runs over {MAX_ITERATIONS:,} loop iterations")
        if not self.iterations & 1023:
            self.tick()

    def emit(self, chars: int) -> None:
        self.output += chars
        if self.output > self.max_chars:
            raise TemplateBoundError(f"renders over {self.max_chars:,} characters")
        self.tick()

    def size(self, size: int) -> None:
        """A string or list about to be built, of `size` characters or items."""
        if size > self.max_chars:
            raise TemplateBoundError(f"builds a value of over {self.max_chars:,} characters")

    def argument(self, value) -> None:
        """A width, count or repeat asked for (not a value being formatted)."""
        if type(value) is int and abs(value) > INT_LIMIT:
            raise TemplateBoundError(f"asks for a size too large ({value:,}; at most {INT_LIMIT:,})")


_BOUNDS: contextvars.ContextVar[RenderBounds | None] = contextvars.ContextVar(
    "usaf_render_bounds", default=None
)


def _bounds() -> RenderBounds:
    bounds = _BOUNDS.get()
    if bounds is None:  # outside `rendering` (a compile-time fold): a budget of its own
        bounds = RenderBounds()
        _BOUNDS.set(bounds)
    return bounds


def _length(value) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


# a width or precision in a format string: '{:>99999}'.format(x), '%99999s' % x
_FORMAT_WIDTH = re.compile(r"\{[^{}]*?(\d{7,})[^{}]*\}|%[-#0 +]*(\d{7,})|%[-#0 +]*\d*\.(\d{7,})")
_STAR_WIDTH = re.compile(r"%[-#0 +]*\*")


def _check_format(text) -> None:
    if isinstance(text, str) and (_FORMAT_WIDTH.search(text) or _STAR_WIDTH.search(text)):
        raise TemplateBoundError("asks for a format width too large (seven digits or more, or '*')")


def _check_str_method(bounds: RenderBounds, method, args, kwargs) -> None:
    """The str methods that can grow a string, sized before they run."""
    text, name = method.__self__, method.__name__
    values = [*args, *kwargs.values()]
    if name in ("center", "ljust", "rjust", "zfill"):
        for value in values:
            bounds.argument(value)
    if name in ("format", "format_map"):
        _check_format(text)
    elif name == "expandtabs":
        bounds.size(len(text) + text.count("\t") * int(values[0] if values else 8))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        bounds.size(len(text) + (text.count(args[0]) + 1) * max(0, len(args[1]) - len(args[0])))
    elif name == "join" and args:
        items = list(args[0])
        bounds.size(len(text) * len(items) + sum(map(_length, items)))
        return items
    return None


def _bounded_filter(name: str, function):
    """A filter whose size arguments, and whose result, are bounded."""

    first = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # after a context, the value

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        bounds = _bounds()
        values = [*args, *kwargs.values()]
        for value in values[first + 1 :]:  # the sizes asked for (widths, counts), not the value filtered
            bounds.argument(value)
        text = next((value for value in values if isinstance(value, str)), "")
        if name == "format":
            _check_format(text)
        if name == "indent":
            width = next((v for v in values[1:] if type(v) is int), 4)
            width = len(width) if isinstance(width, str) else width
            bounds.size(len(text) + (text.count("\n") + 1) * width)
        result = function(*args, **kwargs)
        bounds.size(_length(result))
        bounds.tick()
        return result

    return bounded


class _Bounded(NodeTransformer):
    """Every `{% for %}` iterates through environment.bounded_iter, every `~` goes through
    environment.bounded_concat (Jinja compiles neither through the sandbox's hooks)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(
            nodes.EnvironmentAttribute("bounded_concat"), node.nodes, [], None, None
        ).set_lineno(node.lineno)


class _BoundedTemplate(Template):
    def render(self, *args, **kwargs) -> str:
        return "".join(self.generate(*args, **kwargs))

    def generate(self, *args, **kwargs):
        bounds = _bounds()
        for piece in super().generate(*args, **kwargs):
            bounds.emit(len(piece))
            yield piece


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    template_class = _BoundedTemplate
    # the operators that can build a large value: the sandbox routes them through call_binop (and so never
    # folds them at compile time, where `'x' * 10**10` would be computed before any render)
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def _parse(self, source, name, filename):
        return _Bounded().visit(super()._parse(source, name, filename))

    def call_binop(self, context, operator, left, right):
        bounds = _bounds()
        bounds.tick()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and type(count) is int:
                    bounds.size(len(sequence) * count)
        elif operator == "**":
            if (
                type(left) is int
                and type(right) is int
                and right > 0
                and left.bit_length() * right > POWER_BITS
            ):
                raise TemplateBoundError(f"computes a power too large (over {POWER_BITS:,} bits)")
        elif operator == "+":
            bounds.size(_length(left) + _length(right))
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
        result = super().call_binop(context, operator, left, right)
        bounds.size(_length(result))
        return result

    def call(__self, __context, __obj, *args, **kwargs):
        bounds = _bounds()
        bounds.tick()
        if isinstance(__obj, Macro):
            bounds.depth += 1
            try:
                if bounds.depth > MAX_DEPTH:
                    raise TemplateBoundError(f"calls macros nested over {MAX_DEPTH} deep")
                return super().call(__context, __obj, *args, **kwargs)
            finally:
                bounds.depth -= 1
        if __obj is _BoundedEnvironment.bounded_iter or __obj is _BoundedEnvironment.bounded_concat:
            return __obj(*args)  # (Jinja passes its _loop_vars along; they are not arguments)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format in its own formatter
        if isinstance(getattr(method, "__self__", None), str):
            items = _check_str_method(bounds, method, args, kwargs)
            if items is not None:
                args = (items, *args[1:])
        result = super().call(__context, __obj, *args, **kwargs)
        bounds.size(_length(result))
        return result

    @staticmethod
    def bounded_iter(iterable):
        bounds = _bounds()
        for item in iterable:
            bounds.iterate()
            yield item

    @staticmethod
    def bounded_concat(*parts):
        pieces = [part if isinstance(part, str) else str(part) for part in parts]
        _bounds().size(sum(map(len, pieces)))
        return "".join(pieces)


@functools.lru_cache(maxsize=16)
def _compile(chat_template: str):
    """The template compiled in a _BoundedEnvironment that has transformers' extensions, filters and globals."""
    reference = chat_template_environment()
    environment = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[type(extension) for extension in reference.extensions.values()],
    )
    environment.filters.update(reference.filters)
    environment.filters = {name: _bounded_filter(name, f) for name, f in environment.filters.items()}
    environment.globals.update(reference.globals)
    del environment.globals["lipsum"]  # Jinja's filler text, n paragraphs of it: no chat template's business
    environment.tests.update(reference.tests)
    return environment.from_string(chat_template)


@contextmanager
def rendering(bounds: RenderBounds):
    """transformers' chat-template rendering (apply_chat_template, and what TRL calls) bounded by `bounds` for
    the duration; a bound met raises TemplateBoundError."""
    token = _BOUNDS.set(bounds)
    try:
        with chat_template_compiler(_compile):
            yield
    except RecursionError:
        raise TemplateBoundError("recurses too deep (a macro that calls itself without end?)") from None
    finally:
        _BOUNDS.reset(token)
