"""`select`: what `prepare_model` makes trainable and how it is chosen (`UsafConfig`, the library's own config)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from usaf.config.options import (
    AUTO,
    DEFAULT_DENSITY,
    DEFAULT_RESELECT_EVERY,
    DEFAULT_TARGETS,
    DEFAULT_WORKSPACE_MB,
    GRANULARITIES,
    RATIO_TARGETS,
    SELECTIONS,
    STRATEGIES,
    TARGETS,
    TOKENS_MOST,
    Auto,
    option,
    plain,
)
from usaf.config.section import Section
from usaf.errors import ConfigError, unknown_names


@dataclass(frozen=True)
class UsafConfig(Section):
    """What `prepare_model` makes trainable.

    density: share of each expert tensor's entries to train, in (0, 1].
    num_entries: a global budget of trained expert entries; overrides `density` when set.
    granularity: "element" (arbitrary entries) or "neuron" (row j of gate and up, column j of down).
    strategy: how the budget is spread: "uniform" (every expert tensor alike), "routing" (experts covering
        `routing_coverage` of the task's routed tokens, in proportion to their share; cold experts get nothing),
        "gradient" (global top-k by gradient importance across layers), or "file" (a saved selection, `file`);
        or a strategy registered from Python (`usaf.selection.strategies`), by name or as the object.
    selection: how entries are chosen inside the budget: "random", "magnitude" (largest |w|), "gradient"
        (importance from calibration batches), or "auto": gradient when calibration batches are given (usaf train
        always gives them), else magnitude; seeded by `seed`; or a scorer registered from Python
        (`usaf.selection.scorers`), by name or as the object.
    calibration_batches: batches of the task used by "routing", "gradient" (and selection="gradient"), at least;
        more until `calibration_tokens` supervised tokens are in (at most one pass over the data).
    oversample: candidate entries scored exactly per trained entry (gradient selection), >= 1.
    reselect_every: every K optimizer steps drop the entries that moved least and grow where the gradient is
        largest (0: never); `reselect_fraction` of the entries at first, decaying (cosine) to zero at
        `reselect_until` (a share of the run); gradients of candidates are gathered over `reselect_probe_steps`.
    targets: which native weights may hold trained entries: "experts" (the fused expert tensors), "routers"
        (trained whole, in fp32), "attention" (q/k/v/o and fused variants), "dense_mlp" (dense layers of hybrid
        models, shared experts), "norms", "embeddings" (input embedding rows), "lm_head" (output layer rows).
        `density` (or `num_entries`, split by size) applies to every targeted weight alike unless
        `density_ratios` weighs targets against each other (the total stays the same); with
        strategy="gradient" one global top-k over all of them decides where the budget goes.
    train_router: deprecated (0.1.x configs): routers' weights (and real biases) train when "routers" is in
        `targets`; false takes "routers" out of `targets` when the config is made.
    train_biases: expert biases (gpt-oss) get trainable entries at the same density.
    layers: numbers of the MoE decoder layers to train (None: all, and the weights outside the decoder layers:
        embedding, final norm, output layer); the others stay frozen.
    workspace_mb: bound on the dequantized routed-expert workspace of one projection (quantized bases), or
        "auto" (resolved by usaf train's memory plan; DEFAULT_WORKSPACE_MB where nothing plans).
    """

    density: float | Auto = option(
        AUTO,
        "share of the targeted weights' entries to train, or auto: the largest of 2 %, 1 %, 0.5 % ... that usaf "
        "train's memory plan fits (1 % in prepare_model, which plans nothing)",
        bounds="(0, 1]",
    )
    num_entries: int | None = option(
        None, "global budget of trained entries (split by size); overrides density", bounds="[1, inf)"
    )
    density_ratios: dict = option(
        {},
        "per-target density relative to the others' (e.g. {attention: 10}); the total stays density x the "
        "eligible entries (or num_entries)",
        RATIO_TARGETS,
        bounds="(0, inf)",
    )
    granularity: str = option("element", "expert entries: arbitrary elements or whole neurons", GRANULARITIES)
    strategy: str = option(
        "uniform",
        "how the budget is spread: every tensor alike, routed experts, global gradient top-k, a saved file",
        STRATEGIES,
    )
    selection: str = option(
        "auto", "how entries are chosen inside the budget (auto: gradient given calibration data)", SELECTIONS
    )
    routing_coverage: float = option(
        0.5, "strategy=routing: share of routed tokens the chosen experts cover", bounds="(0, 1]"
    )
    calibration_batches: int = option(
        8,
        "batches of the training data used to calibrate the selection (at least; see calibration_tokens)",
        bounds="[1, inf)",
        most=TOKENS_MOST,
    )
    # 8 batches of 8 x 128 tokens left the forgetting of a run 0.015 nats apart between calibration draws, 32 of
    # them 0.004 (issue 39, bench/results/quality-seeds-*.md); on the arithmetic shift 32 k tokens still forgot
    # 0.057 nats apart across seeds, 64 k 0.020, 128 k 0.015 (quality-calibration-*.md): 64 k, half 128 k's cost.
    # 8 batches of 4 x 2048 already hold 64 k
    calibration_tokens: int = option(
        65536,
        "calibrate on at least this many supervised tokens: more batches than calibration_batches where batches "
        "are small, at most one pass over the data (0: calibration_batches alone)",
        bounds="[0, inf)",
        most=TOKENS_MOST,
    )
    oversample: float = option(
        4.0, "gradient selection: candidate entries scored per trained entry", bounds="[1, inf)"
    )
    file: str | None = option(
        None, "strategy=file: a selection.safetensors saved by a run or `usaf select`", path=True
    )
    reselect_every: int = option(
        DEFAULT_RESELECT_EVERY,
        "every N steps drop entries that moved least and grow where gradients are large (0: off; usaf train)",
    )
    reselect_fraction: float = option(
        0.3, "share of entries replaced at the first reselection, decaying", bounds="[0, 1)"
    )
    reselect_until: float = option(0.75, "share of the run after which reselection stops", bounds="(0, 1]")
    reselect_probe_steps: int = option(
        2, "steps of gradients gathered for the candidates before a reselection", bounds="[1, inf)"
    )
    seed: int = option(0, "seed of random selection")
    targets: list = option(
        list(DEFAULT_TARGETS), "weights that hold trained entries (some of the names)", TARGETS
    )
    train_router: bool = option(
        True, "deprecated: routers train when 'routers' is in targets; false takes them out of targets"
    )
    train_biases: bool = option(True, "expert biases (gpt-oss) get entries at the same density")
    layers: list[int] | None = option(
        None, "decoder layer numbers to train (None: all, with the embedding and output layer)"
    )
    workspace_mb: int | Auto = option(
        AUTO,
        "bound (MB) on one projection's dequantized routed-expert workspace (quantized or streamed experts), or "
        "auto: all of a projection's routed experts at once where usaf train's memory plan fits them, else the "
        f"largest half of that which fits, at least {DEFAULT_WORKSPACE_MB} ({DEFAULT_WORKSPACE_MB} in "
        "prepare_model, which plans nothing)",
        bounds="[1, inf)",
        most=1 << 30,
    )

    NAME = "UsafConfig"

    def check_together(self, where: str) -> None:
        if self.strategy == "file" and not self.file:
            raise ConfigError(
                f"{where}.strategy='file' needs `file`: a selection.safetensors saved by a run."
            )
        # the deprecated alias (0.1.x configs): train_router=false takes routers out of the targets
        if not self.train_router and "routers" in self.targets:
            if self.targets == ["routers"]:
                raise ConfigError(
                    f"{where}: nothing to train: select.targets is [routers] with select.train_router=false: set "
                    "train_router=true or add targets."
                )
            object.__setattr__(self, "targets", [t for t in self.targets if t != "routers"])

    @property
    def trains_routers(self) -> bool:
        return "routers" in self.targets

    @property
    def fixed_density(self) -> float:
        """The density as a number: auto that no memory plan resolved (`usaf.train.memory_plan` does for usaf
        train) reads as DEFAULT_DENSITY."""
        return DEFAULT_DENSITY if self.density is AUTO else self.density

    @property
    def fixed_workspace_mb(self) -> int:
        """The workspace bound as a number: auto that no memory plan resolved reads as DEFAULT_WORKSPACE_MB."""
        return DEFAULT_WORKSPACE_MB if self.workspace_mb is AUTO else self.workspace_mb

    def to_dict(self) -> dict:
        return plain(asdict(self))

    @classmethod
    def from_dict(cls, data: dict) -> UsafConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"UsafConfig: {unknown_names('key', unknown, known)}")
        return cls(**data)
