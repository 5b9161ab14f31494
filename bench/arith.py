"""The second domain shift of bench/quality.py: arithmetic after prose. The shift model (scripts/make_shift_model.py,
pretrained on English prose) is fine-tuned on lines of integer arithmetic, a domain unlike the first shift's man
pages: digits and operators only, and every answer follows from its line.

    417 + 86 = 503
    93 * 17 = 1581
    1200 - 347 = 853

Operands have 1 to 4 digits (the size drawn first, so short and long numbers are equally common); the operator
is +, - or *. Deterministic: random.Random(seed); the held-out part is drawn with another seed, so its lines are
new draws (a short line such as `3 + 4 = 7` can occur in both, as it would in any such text)."""

from __future__ import annotations

import random

TRAIN_SEED, HELD_OUT_SEED = 0, 1
TRAIN_BYTES, HELD_OUT_BYTES = 2_000_000, 300_000
OPERATORS = "+-*"


def operand(rng: random.Random) -> int:
    digits = rng.randint(1, 4)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def line(rng: random.Random) -> str:
    a, b, op = operand(rng), operand(rng), rng.choice(OPERATORS)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b} = {value}\n"


def text(seed: int, size: int) -> bytes:
    """Whole lines of arithmetic, `size` bytes at least (ASCII: a byte a character)."""
    rng, lines, total = random.Random(seed), [], 0
    while total < size:
        lines.append(line(rng))
        total += len(lines[-1])
    return "".join(lines).encode("ascii")


def domain() -> dict[str, bytes]:
    """{"train", "held_out"}: as make_shift_model.domains() gives each domain."""
    return {"train": text(TRAIN_SEED, TRAIN_BYTES), "held_out": text(HELD_OUT_SEED, HELD_OUT_BYTES)}
