"""The engine's configuration: what to train and how to choose it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .errors import UsafError

GRANULARITIES = ("element", "neuron")
SELECTIONS = ("random", "magnitude")


@dataclass
class UsafConfig:
    """What `prepare_model` makes trainable.

    density: share of each expert tensor's entries to train, in (0, 1].
    num_entries: a global budget of trained expert entries; overrides `density` when set.
    granularity: "element" (arbitrary entries) or "neuron" (row j of gate and up, column j of down).
    selection: "random" or "magnitude" (largest |w| first); seeded by `seed`.
    train_router: routers' weights (and real biases) become trainable.
    train_biases: expert biases (gpt-oss) get trainable entries at the same density.
    layers: indices of the MoE layers to train (None: all); the others stay frozen.
    workspace_mb: bound on the dequantized routed-expert workspace of one projection (quantized bases).
    """

    density: float = 0.005
    num_entries: int | None = None
    granularity: str = "element"
    selection: str = "magnitude"
    seed: int = 0
    train_router: bool = True
    train_biases: bool = True
    layers: list[int] | None = None
    workspace_mb: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.density, (int, float)) or not 0.0 < float(self.density) <= 1.0:
            raise UsafError(f"UsafConfig.density must be in (0, 1], got {self.density!r}.")
        if self.num_entries is not None and (not isinstance(self.num_entries, int) or self.num_entries < 1):
            raise UsafError(
                f"UsafConfig.num_entries must be a positive integer or None, got {self.num_entries!r}."
            )
        if self.granularity not in GRANULARITIES:
            raise UsafError(
                f"UsafConfig.granularity must be one of {GRANULARITIES}, got {self.granularity!r}."
            )
        if self.selection not in SELECTIONS:
            raise UsafError(f"UsafConfig.selection must be one of {SELECTIONS}, got {self.selection!r}.")
        if self.workspace_mb < 1:
            raise UsafError(f"UsafConfig.workspace_mb must be >= 1, got {self.workspace_mb!r}.")
        if self.layers is not None:
            self.layers = [int(i) for i in self.layers]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> UsafConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsafError(f"Unknown UsafConfig keys {unknown}; allowed keys: {sorted(known)}.")
        return cls(**data)
