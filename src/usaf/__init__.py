"""usaf: fine-tune a Mixture-of-Experts model's own expert weights, sparsely, on a frozen base."""

__version__ = "0.1.0"

from .config import UsafConfig
from .errors import UsafError
from .export import delta_from_trainer_checkpoint, load_delta
from .loss import causal_lm_loss, chunked_causal_lm_loss
from .optim import CompactAdamW
from .prepare import enable_recomputation, get_delta, prepare_model, trainable_summary

__all__ = [
    "CompactAdamW",
    "UsafConfig",
    "UsafError",
    "__version__",
    "causal_lm_loss",
    "chunked_causal_lm_loss",
    "delta_from_trainer_checkpoint",
    "enable_recomputation",
    "get_delta",
    "load_delta",
    "prepare_model",
    "trainable_summary",
]
