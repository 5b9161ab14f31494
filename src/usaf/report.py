"""`usaf report`: a run's curves and its routers' expert loads, drawn as PNGs from what the run wrote.

Inputs in the run directory:
- metrics.jsonl: one JSON object per logged step ({"step": N, "loss": ..., "lr": ..., "eval/loss": ...,
  "tokens_per_s": ..., "router/cv_max": ...}); a resumed run appends, so a step logged twice keeps its last record.
  Evaluations are eval/* keys: one before training (at the first step logged), periodic ones, and the final one
  after training, in a row of its own marked "final": true.
- router_load.json: {"layers": [decoder layer numbers], "before": [[share per expert] per layer],
  "after": [[...]]}, the share of routed tokens per expert before and after training (null: not observed);
  written by the trainer through `write_router_load`.

Outputs: report.png (curves) and router_load.png (per-layer heatmaps before, after, and their difference).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from usaf.errors import RunStateError, UsafError, first_line
from usaf.files import METRICS_FILE, ROUTER_LOAD_FILE
from usaf.io.atomic import atomic_file, atomic_json

REPORT_PNG = "report.png"
ROUTER_LOAD_PNG = "router_load.png"

# (panel title, keys drawn in it); router/* keys not listed get a panel each
CURVES = (
    ("loss", ("loss", "eval/loss")),
    ("learning rate", ("lr",)),
    ("tokens / s", ("tokens_per_s",)),
    ("router load balance (worst layer)", ("router/cv_max", "router/entropy_min")),
    ("dead experts", ("router/dead",)),
    ("routing drift from base (KL)", ("router/drift",)),
    ("router losses", ("router/balance_loss", "router/z_loss")),
    ("preference (DPO)", ("rewards/margins", "rewards/accuracies", "eval/margin", "eval/accuracy")),
)
FINAL_KEY = "final"  # the final evaluation's row (usaf.train.metrics)


def write_router_load(run_dir: str | Path, before, after, layers) -> Path:
    """Write router_load.json: `before`/`after` are [layers, E] load shares (tensors, arrays or lists; NaN for
    unobserved), `layers` the decoder layer number of each row."""
    before, after = _rows(before), _rows(after)
    layers = [int(x) for x in layers]
    if len(before) != len(layers) or len(after) != len(layers):
        raise UsafError(
            f"router load: {len(before)} rows before, {len(after)} after, {len(layers)} layer numbers; "
            "they must match."
        )
    path = Path(run_dir) / ROUTER_LOAD_FILE
    atomic_json(path, {"layers": layers, "before": before, "after": after})
    return path


def _rows(matrix) -> list[list[float | None]]:
    rows = matrix.tolist() if hasattr(matrix, "tolist") else matrix
    return [[None if v is None or not math.isfinite(v) else float(v) for v in row] for row in rows]


def read_metrics(path: str | Path) -> list[dict]:
    """Records of metrics.jsonl in step order; a step logged again (after a resume) keeps its last record.
    Records without a step or unreadable lines (a run killed mid-write) are skipped."""
    by_step: dict[int, dict] = {}
    unread = 0
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is skipped like a torn one
        for line in f:
            try:
                record = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                unread += 1
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                by_step.setdefault(record["step"], {}).update(record)
            else:
                unread += 1
    if unread and not by_step:
        raise RunStateError(
            f"{path} holds no metrics ({unread} lines, none a JSON object with a step): it is not the metrics "
            f"file `usaf train` writes; move it aside to draw only the router loads."
        )
    return [by_step[s] for s in sorted(by_step)]


def render_report(run_dir: str | Path) -> list[Path]:
    """Draw report.png and router_load.png from whichever inputs the run directory holds; returns the PNGs."""
    run_dir = Path(run_dir)
    metrics, loads = run_dir / METRICS_FILE, run_dir / ROUTER_LOAD_FILE
    if not metrics.exists() and not loads.exists():
        raise RunStateError(
            f"{run_dir} has neither {METRICS_FILE} nor {ROUTER_LOAD_FILE}: is it a usaf run directory?"
        )
    written = []
    if metrics.exists():
        written.append(render_curves(read_metrics(metrics), run_dir / REPORT_PNG))
    if loads.exists():
        try:
            data = json.loads(loads.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise RunStateError(
                f"{loads} is not readable JSON ({first_line(err)}); `usaf train` writes it at the end of a run: finish the run "
                "or delete the file to draw only the curves."
            ) from None
        if not isinstance(data, dict):
            raise RunStateError(
                f"{loads} holds a JSON {type(data).__name__}, not the object `usaf train` writes (layers, before, "
                "after); finish the run or delete the file to draw only the curves."
            )
        written.append(render_router_load(data, run_dir / ROUTER_LOAD_PNG))
    return written


def eval_lines(run_dir: str | Path) -> list[str]:
    """What `usaf report` prints of the run's evaluations: the final one (else the last, in a run that has not
    finished) and the one before training, each with its step."""
    metrics = Path(run_dir) / METRICS_FILE
    if not metrics.exists():
        return []
    evals = [r for r in read_metrics(metrics) if any(_is_number(v) for k, v in r.items() if _is_eval(k))]
    if not evals:
        return []
    last, first = evals[-1], evals[0]
    said = "final eval" if last.get(FINAL_KEY) is True else "last eval (the run has no final evaluation yet)"
    line = f"{said} at step {last['step']}: {_eval_numbers(last)}"
    if first is not last:
        when = "before training" if first["step"] == 0 else f"first at step {first['step']}"
        line += f"; {when}: {_eval_numbers(first)}"
    return [line]


def _is_eval(key: str) -> bool:
    return key.startswith("eval/")


def _eval_numbers(record: dict) -> str:
    """ "loss 2.9512, perplexity 19.13": the evaluation's measures (its counts of tokens or pairs left out)."""
    return ", ".join(
        f"{k[len('eval/') :]} {v:.4f}"
        for k, v in record.items()
        if _is_eval(k) and _is_number(v) and not isinstance(v, int)
    )


def render_curves(records: list[dict], out: Path) -> Path:
    plt = _pyplot()
    panels = _panels(records)
    if not panels:
        raise RunStateError(f"no numeric metrics to draw for {out}.")
    columns = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 3.0 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels, strict=False):
        for key, (steps, values) in series.items():
            style = "o-" if len(steps) < 30 else "-"
            ax.plot(steps, values, style, markersize=3, linewidth=1.2, label=key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if len(series) > 1:
            ax.legend(fontsize=8)
        if title == "learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle("usaf run", fontsize=12)
    fig.tight_layout()
    atomic_file(Path(out), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))  # never through a link
    plt.close(fig)
    return out


def _panels(records: list[dict]) -> list[tuple[str, dict]]:
    """(title, {key: (steps, values)}) for every panel with data."""

    def series(key):
        points = [(r["step"], r[key]) for r in records if _is_number(r.get(key))]
        return ([s for s, _ in points], [v for _, v in points]) if points else None

    panels, listed = [], set()
    for title, keys in CURVES:
        listed.update(keys)
        found = {k: s for k in keys if (s := series(k)) is not None}
        if found:
            panels.append((title, found))
    extra = sorted({k for r in records for k in r if k.startswith("router/") and k not in listed})
    for key in extra:
        s = series(key)
        if s is not None:
            panels.append((key, {key: s}))
    return panels


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def render_router_load(data: dict, out: Path) -> Path:
    """Heatmaps [layer x expert] of the load share before and after training, and after - before."""
    import numpy as np

    plt = _pyplot()
    try:
        layers = list(data["layers"])
        before = np.array([[np.nan if v is None else v for v in row] for row in data["before"]], dtype=float)
        after = np.array([[np.nan if v is None else v for v in row] for row in data["after"]], dtype=float)
    except (KeyError, TypeError, ValueError) as err:
        raise RunStateError(
            f"{ROUTER_LOAD_FILE} is malformed ({err!r}); expected layers, before, after: finish the run or delete it."
        ) from None
    if before.shape != after.shape or before.ndim != 2 or before.shape[0] != len(layers):
        raise RunStateError(
            f"{ROUTER_LOAD_FILE}: before {before.shape}, after {after.shape}, {len(layers)} layers."
        )
    num_layers, num_experts = before.shape
    top = np.nanmax([np.nanmax(before), np.nanmax(after), 1.0 / num_experts]) if num_layers else 1.0
    diff = after - before
    span = float(np.nanmax(np.abs(diff))) if np.isfinite(diff).any() else 1.0
    width = min(22.0, 4.0 + 3 * max(3.0, num_experts * 0.12))
    height = min(18.0, 2.0 + max(2.0, num_layers * 0.28))
    fig, axes = plt.subplots(1, 3, figsize=(width, height), squeeze=False)
    maps = (
        ("before training", before, "viridis", 0.0, top),
        ("after training", after, "viridis", 0.0, top),
        ("after - before", diff, "RdBu_r", -span or -1.0, span or 1.0),
    )
    for ax, (title, matrix, cmap, low, high) in zip(axes[0], maps, strict=True):
        colors = plt.get_cmap(cmap).with_extremes(bad="#d9d9d9")  # grey: not observed
        image = ax.imshow(matrix, aspect="auto", cmap=colors, vmin=low, vmax=high, interpolation="nearest")
        cv = _mean_cv(matrix) if cmap == "viridis" else None
        ax.set_title(title + (f"  (mean load cv {cv:.2f})" if cv is not None else ""), fontsize=10)
        ax.set_xlabel("expert", fontsize=9)
        ax.set_ylabel("layer", fontsize=9)
        step = max(1, num_layers // 24)
        ax.set_yticks(range(0, num_layers, step))
        ax.set_yticklabels([str(layers[i]) for i in range(0, num_layers, step)], fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=8)
    fig.suptitle("share of routed tokens per expert (grey: not observed)", fontsize=12)
    fig.tight_layout()
    atomic_file(Path(out), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))  # never through a link
    plt.close(fig)
    return out


def _mean_cv(matrix) -> float | None:
    import numpy as np

    cvs = [float(np.std(row) / np.mean(row)) for row in matrix if np.isfinite(row).all() and np.mean(row) > 0]
    return sum(cvs) / len(cvs) if cvs else None


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed (servers, CI)
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsafError("usaf report needs matplotlib: pip install usaf[report]") from None
    return plt
