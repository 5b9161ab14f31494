"""Mixing: the training sources drawn by weight (data.weights), as axolotl and LLaMA-Factory mix theirs, through
`datasets.interleave_datasets` (its seeded draws and stopping strategies, not a copy of them).

Whole records are drawn, not rows: the windows of a long record and the two documents of a preference pair stay
together, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from usaf.data.tokenize import Documents
from usaf.errors import ConfigError

STOPPING = ("first_exhausted", "all_exhausted")


@dataclass(frozen=True)
class Mixing:
    weights: tuple[float, ...]  # one a source, normalized when drawn
    seed: int = 0
    stopping: str = "first_exhausted"  # or all_exhausted (datasets' stopping_strategy)

    def check(self, sources: int) -> None:
        if len(self.weights) != sources:
            raise ConfigError(
                f"data.weights has {len(self.weights)} entries but the training data {sources} sources; give one "
                "weight a data.train entry, in order."
            )
        if self.stopping not in STOPPING:
            raise ConfigError(
                f"data.mix_stopping must be one of {', '.join(STOPPING)}, got {self.stopping!r}."
            )

    def interleave(self, parts: list):
        """`parts` (Datasets or IterableDatasets, one a weight) drawn by `datasets.interleave_datasets` with the
        normalized weights, the seed and the stopping strategy."""
        import datasets

        total = sum(self.weights)
        return datasets.interleave_datasets(
            parts,
            probabilities=[w / total for w in self.weights],
            seed=self.seed,
            stopping_strategy=self.stopping,
        )


def _record_starts(documents: Documents) -> list[int]:
    """The index of each record's first document, and the end: a record's documents are consecutive and share
    their `records` entry."""
    starts = [i for i, where in enumerate(documents.records) if i == 0 or where != documents.records[i - 1]]
    return [*starts, len(documents.records)]


def mix(parts: list[Documents], names: list[str], mixing: Mixing) -> tuple[Documents, str]:
    """The sources' documents drawn record by record with the mixing's probabilities (seeded), and the line that
    says how many records each gave."""
    import datasets

    mixing.check(len(parts))
    starts = [_record_starts(part) for part in parts]
    draws = [
        datasets.Dataset.from_dict({"source": [i] * (len(s) - 1), "record": list(range(len(s) - 1))})
        for i, s in enumerate(starts)
    ]
    order = mixing.interleave(draws)
    mixed, taken = Documents(), [0] * len(parts)
    for source, record in zip(order["source"], order["record"], strict=True):
        part, first, end = parts[source], starts[source][record], starts[source][record + 1]
        mixed.ids += part.ids[first:end]
        mixed.labels += part.labels[first:end]
        mixed.records += part.records[first:end]
        mixed.desirable += part.desirable[first:end]  # train.objective=kto: each document's label
        taken[source] += 1
    counts = ", ".join(
        f"{count:,} of {name}'s {len(s) - 1:,}" for count, name, s in zip(taken, names, starts, strict=True)
    )
    weights = "/".join(f"{w:g}" for w in mixing.weights)
    line = f"data: mixed by data.weights {weights} ({mixing.stopping}, seed {mixing.seed}): records {counts}"
    return mixed, line
