"""usaf: fine-tune a Mixture-of-Experts model's own expert weights, sparsely, on a frozen base."""

__version__ = "0.1.0"

from .config import UsafConfig
from .errors import UsafError
from .loss import chunked_causal_lm_loss
from .prepare import enable_recomputation, get_delta, prepare_model, trainable_summary

__all__ = [
    "UsafConfig",
    "UsafError",
    "__version__",
    "chunked_causal_lm_loss",
    "enable_recomputation",
    "get_delta",
    "prepare_model",
    "trainable_summary",
]
