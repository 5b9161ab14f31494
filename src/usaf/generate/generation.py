"""Generation with transformers' own `generate`: a prompt's tokens (a chat through the model's template, rendered
within usaf's bounds), greedy unless asked to sample, one prompt at a time (no padding: the tokens are the ones
`generate` gives for that prompt alone).

The model's context bounds it: a prompt and its new tokens together take at most max_position_embeddings
positions. --max-new-tokens above what is left after a prompt is cut to it (the command says so in one line); a
prompt that leaves no position is refused in one line naming it (never cut from the left: which part of a
prompt matters is the writer's to say), and one of more characters than the context can hold is refused before
it is tokenized (bounded memory, records.TextLimit)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from usaf.data.records import TextLimit
from usaf.data.templates import bounded_render, use_chat_template
from usaf.errors import ConfigError, DataError, ModelError, first_line
from usaf.generate.prompts import Prompt
from usaf.model.hf import max_positions

MAX_NEW_TOKENS = 1 << 16
# below this, logits / temperature overflow (1e-300 is 0 in float32) and sampling fails; a temperature this low
# samples the most likely token anyway: greedy (no --do-sample) is what it asks for
MIN_TEMPERATURE = 1e-3
MAX_SEED = (1 << 64) - 1  # torch.manual_seed's range


@dataclass
class Sampling:
    """The options of `generate`, named as transformers names them; greedy unless `do_sample`."""

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    repetition_penalty: float = 1.0
    seed: int = 0

    def check(self) -> Sampling:
        """Each option in its range, or one line naming it and the range."""
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ConfigError(
                f"--max-new-tokens must be from 1 to {MAX_NEW_TOKENS:,}, not {self.max_new_tokens}."
            )
        if not (math.isfinite(self.temperature) and self.temperature >= MIN_TEMPERATURE):
            raise ConfigError(
                f"--temperature must be a finite number from {MIN_TEMPERATURE:g} up, not {self.temperature:g} "
                "(for the most likely token every time, leave out --do-sample)."
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], not {self.top_p:g}.")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be 0 (off) or more, not {self.top_k}.")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigError(
                f"--repetition-penalty must be a finite number above 0, not {self.repetition_penalty:g}."
            )
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"--seed must be an integer from 0 to {MAX_SEED:,}, not {self.seed}.")
        return self

    def arguments(self, tokenizer) -> dict:
        """Keyword arguments of `generate`; the model's generation_config may ask to sample: greedy overrides it."""
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        common = {"max_new_tokens": self.max_new_tokens, "pad_token_id": pad}
        if not self.do_sample:
            return {**common, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {
            **common,
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
        }


def tokenizer_for_generation(tokenizer, chat_template_setting: str = "") -> None:
    """Check that `tokenizer` can read prompts and write text, and give it the run's chat template."""
    if getattr(tokenizer, "missing", False):
        raise ModelError(
            "this model folder has no tokenizer files: usaf generate needs the tokenizer to read prompts and "
            "write text; copy the base's tokenizer files beside it."
        )
    use_chat_template(tokenizer, chat_template_setting)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def context_positions(model) -> int | None:
    """The model's max_position_embeddings (its text model's), or None where its config does not say."""
    return max_positions(model.config)


class OverContext(DataError):
    """A prompt that leaves the model no position to generate in."""


def prompt_ids(
    tokenizer, prompt: Prompt, where: str, positions: int | None = None, limit: TextLimit | None = None
) -> list[int]:
    """The prompt's tokens: a chat rendered by the model's template with the assistant's turn opened.
    positions: the model's context, which the prompt must leave a position of (else OverContext); limit: its
    `TextLimit.of(tokenizer, positions)`, which reads the whole vocabulary: a caller with many prompts makes it once."""
    if positions is not None:
        limit = limit or TextLimit.of(tokenizer, positions)
        texts = (
            [prompt.text] if prompt.messages is None else [str(m.get("content", "")) for m in prompt.messages]
        )
        chars = sum(map(len, texts))
        if chars > limit.chars:  # more tokens than fit: said without tokenizing
            raise OverContext(
                f"{where}: the prompt ({chars:,} characters) is longer than the model's context of {positions} "
                "positions (max_position_embeddings); shorten it."
            )
    ids = _prompt_ids(tokenizer, prompt, where)
    if positions is not None and len(ids) >= positions:
        raise OverContext(
            f"{where}: the prompt is {len(ids):,} tokens, and the model's context is {positions} positions "
            "(max_position_embeddings): none is left to generate in; shorten it."
        )
    return ids


def _prompt_ids(tokenizer, prompt: Prompt, where: str) -> list[int]:
    if prompt.messages is None:
        return list(tokenizer(prompt.text)["input_ids"])
    if not has_chat_template(tokenizer):
        raise DataError(
            f'{where}: a chat prompt, but the model has no chat template; give {{"prompt": "..."}} text, or '
            "a template with --set data.chat_template=FILE.jinja."
        )
    try:
        text = bounded_render(tokenizer, list(prompt.messages), None, add_generation_prompt=True)
    except Exception as err:  # jinja errors, a template's raise_exception(), a bound met
        raise DataError(f"{where}: the chat template failed: {first_line(err)}") from None
    # the rendered chat carries its own special tokens, as apply_chat_template(tokenize=True) leaves them
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def new_tokens(sampling: Sampling, prompt_tokens: int, positions: int | None) -> int:
    """The tokens to generate after a prompt: --max-new-tokens, at most what the model's context leaves."""
    if positions is None:
        return sampling.max_new_tokens
    return max(1, min(sampling.max_new_tokens, positions - prompt_tokens))


def cut_line(sampling: Sampling, prompt_lengths: list[int], positions: int | None) -> str | None:
    """The line that says --max-new-tokens was cut to the model's context (for how many prompts), or None."""
    cut = [n for n in prompt_lengths if new_tokens(sampling, n, positions) < sampling.max_new_tokens]
    if not cut:
        return None
    most = new_tokens(sampling, min(cut), positions)
    which = f" for {len(cut)} of {len(prompt_lengths)} prompts" if len(prompt_lengths) > 1 else ""
    return (
        f"note: --max-new-tokens {sampling.max_new_tokens:,} is cut to at most {most:,}{which}: a prompt and "
        f"its new tokens fit the model's context of {positions} positions (max_position_embeddings)"
    )


@torch.no_grad()
def generate_ids(model, ids: list[int], sampling: Sampling, tokenizer, device, streamer=None) -> list[int]:
    """The new tokens `generate` gives after `ids` (sampling seeded per call: the same prompt, the same text)."""
    if sampling.do_sample:
        torch.manual_seed(sampling.seed)
    inputs = torch.tensor([ids], device=device)
    arguments = sampling.arguments(tokenizer)
    arguments["max_new_tokens"] = new_tokens(sampling, len(ids), context_positions(model))
    out = model.generate(
        input_ids=inputs, attention_mask=torch.ones_like(inputs), streamer=streamer, **arguments
    )
    return out[0, len(ids) :].tolist()


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)
