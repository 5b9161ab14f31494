"""What `usaf generate` and `usaf chat` run: a run folder (its latest trained values, without exporting), a
merged export or any model folder, or a base plus `--delta` (a prepared store too, or any base with
`--set model.quant=...`); `usaf.io.model_source` says which.

A `Target` gives the tuned model and, for `--compare-base`, its base: for a model usaf prepared (a run, a
quantized base) the same weights with the trained entries switched off (`usaf.engine.base_weights`); for a plain
base plus a delta the base as loaded, before the delta is written in (so the base is asked first); for a merged
export, the `--base` model folder.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from usaf import kernels
from usaf.config import ModelSection, TrainSection
from usaf.engine.base_weights import base_weights
from usaf.engine.installed import sparse_modules
from usaf.errors import ConfigError, ModelError, RunStateError
from usaf.export.apply_delta import check_delta_base, load_delta
from usaf.export.delta import read_delta
from usaf.files import SELECTION_FILE
from usaf.io.model_source import STORE, model_source
from usaf.io.source import check_model_files
from usaf.model.hf import load_causal_lm
from usaf.train import checkpoint, runtime
from usaf.train.checkpoint import restore_trainable
from usaf.train.memory_plan import resolve_storage
from usaf.train.session import config_for_model, config_of_run, load_model, load_tokenizer, with_model_source


class Target:
    """A model to generate with: `tuned()` the fine-tune, `base()` a context giving its base (see the module)."""

    def __init__(self, chat_template: str, model, tokenizer, device, label: str, delta=None, base_dir=None):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.chat_template = chat_template  # data.chat_template: how prompts given as messages are rendered
        self.label = label  # what the first line says was loaded
        self._pending_delta, self._base_dir = delta, base_dir

    @property
    def prepared(self) -> bool:
        return any(True for _ in sparse_modules(self.model))

    def tuned(self):
        """The fine-tuned model (a pending delta is written in now: after this the plain base is gone)."""
        if self._pending_delta is not None:
            load_delta(self.model, self._pending_delta, unchecked_base=True)
            self._pending_delta = None
        return self.model

    def can_compare(self) -> str | None:
        """None when a base can be given, else what to add."""
        if self.prepared or self._pending_delta is not None or self._base_dir is not None:
            return None
        return "a merged export or model folder has no base beside it: give --base BASE_DIR to compare with"

    @contextlib.contextmanager
    def base(self):
        """The base model, for as long as the block lasts."""
        if (missing := self.can_compare()) is not None:
            raise ModelError(f"--compare-base: {missing}.")
        if self.prepared:
            with base_weights(self.model) as model:
                yield model
        elif self._pending_delta is not None:
            yield self.model  # nothing written yet: it is the base
        else:
            check_model_files(self._base_dir)
            model = load_causal_lm(self._base_dir, dtype=next(self.model.parameters()).dtype).to(self.device)
            model.eval()
            try:
                yield model
            finally:
                del model


def _session(model: ModelSection, train: TrainSection):
    kernels.use(train.kernels)
    device = runtime.resolve_device(model.device)
    return device, runtime.resolve_dtype(model.dtype, device)


def open_target(
    target: str,
    delta: str | None,
    base_dir: str | None,
    overrides: list[str],
    *,
    unchecked_base: bool = False,
) -> Target:
    """Load `target` for generation (see the module); nothing is written anywhere. A `delta` meets its base
    as in `usaf apply`: checked to be the base it was trained on, and refused without a base record unless
    `unchecked_base`."""
    source = model_source(target)
    if source.is_run:
        if delta is not None:
            raise ConfigError(
                f"{target} is a run: its trained values are used as they are; --delta goes with a base model."
            )
        return _open_run(Path(source.path), overrides)
    config = config_for_model(target, overrides)
    device, dtype = _session(config.model, config.train)
    tokenizer = load_tokenizer(config.model.path)
    loaded = delta  # the delta's path, or the delta itself once read for its check (read once)
    if delta is not None:
        if not Path(delta).expanduser().is_file():
            raise ModelError(f"--delta {delta} is not a file; give a delta written by `usaf export --delta`.")
        # the check usaf apply makes, before anything is generated: a store's base is the checkpoint it was
        # prepared from
        checked = source.base_path if source.kind == STORE else config.model.path
        if checked is not None and Path(checked).is_dir():
            loaded = read_delta(delta)
            check_delta_base(loaded, checked, unchecked_base=unchecked_base)
        elif not unchecked_base:
            raise ModelError(
                f"--delta {delta}: {target} is a store whose source checkpoint ({checked}) is gone, so the delta's "
                "base cannot be checked; restore that folder, or pass --unchecked-base to use the delta unchecked."
            )
    config = resolve_storage(config, device, dtype)  # model.quant=auto: what the card fits
    quant = config.model.quant if source.quant == "none" else source.quant
    if quant != "none":
        # a quantized base (a store, a published checkpoint, model.quant) trains, and so generates, through usaf's
        # engine: the delta becomes its trained values
        model = load_model(config, device, dtype, recompute=False)
        if delta is not None:
            load_delta(model, loaded, unchecked_base=True)
        label, pending = f"{target} ({quant})", None
    else:
        check_model_files(config.model.path)
        model = load_causal_lm(config.model.path, dtype=dtype).to(device)
        label, pending = target, loaded
    model.eval()
    label += f" + {delta}" if delta is not None else ""
    return Target(
        config.data.chat_template, model, tokenizer, device, label, delta=pending, base_dir=base_dir
    )


def _open_run(run_dir: Path, overrides: list[str]) -> Target:
    config = config_of_run(run_dir, overrides)
    saved = checkpoint.latest(run_dir)
    if saved is None:
        raise RunStateError(
            f"{run_dir} has no finished checkpoint yet: train it first (or wait for its first)."
        )
    config = with_model_source(config)
    device, dtype = _session(config.model, config.train)
    tokenizer = load_tokenizer(config.model.path)
    model = load_model(config, device, dtype, selection_file=run_dir / SELECTION_FILE, recompute=False)
    restore_trainable(model, checkpoint.load(saved)["trainable"], saved)
    model.eval()
    return Target(config.data.chat_template, model, tokenizer, device, f"{run_dir} at {saved.name}")
