"""usaf: fine-tune a Mixture-of-Experts model's own expert weights, sparsely, on a frozen base."""

__version__ = "0.1.0"

from .config import UsafConfig  # noqa: E402
from .errors import UsafError  # noqa: E402
from .loss import chunked_causal_lm_loss  # noqa: E402
from .prepare import get_delta, prepare_model, trainable_summary  # noqa: E402

__all__ = [
    "UsafConfig",
    "UsafError",
    "__version__",
    "chunked_causal_lm_loss",
    "get_delta",
    "prepare_model",
    "trainable_summary",
]
