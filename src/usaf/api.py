"""The public API, as `import usaf` offers it (`usaf/__init__.py` has why it is a module of its own): importing it
loads the engine, the training job and every built-in plug-in (strategies, scorers, target kinds, trackers), so a
config made after it knows every choice."""

from usaf import train  # callable: usaf.train(config, run_dir) runs the job (see usaf.train)
from usaf.base.load import load_prepared
from usaf.config import RunConfig, UsafConfig
from usaf.engine.base_weights import BaseReference, base_weights
from usaf.engine.loss import causal_lm_loss, chunked_causal_lm_loss
from usaf.errors import UsafError
from usaf.export.apply_delta import load_delta
from usaf.export.live import save_delta
from usaf.export.trainer import delta_from_trainer_checkpoint
from usaf.prepare import enable_recomputation, get_delta, prepare_model, trainable_summary
from usaf.train import loop as _loop  # noqa: F401 (loaded, so that usaf.train(...) finds it)
from usaf.train.optim import CompactAdamW
from usaf.version import __version__

__all__ = [
    "BaseReference",
    "CompactAdamW",
    "RunConfig",
    "UsafConfig",
    "UsafError",
    "__version__",
    "base_weights",
    "causal_lm_loss",
    "chunked_causal_lm_loss",
    "delta_from_trainer_checkpoint",
    "enable_recomputation",
    "get_delta",
    "load_delta",
    "load_prepared",
    "prepare_model",
    "save_delta",
    "train",
    "trainable_summary",
]
