"""Generation with transformers' own `generate`: a prompt's tokens (a chat through the model's template, rendered
within usaf's bounds), greedy unless asked to sample, one prompt at a time (no padding: the tokens are the ones
`generate` gives for that prompt alone)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usaf.data.templates import bounded_render, use_chat_template
from usaf.errors import UsafError, first_line
from usaf.generate.prompts import Prompt

MAX_NEW_TOKENS = 1 << 16


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
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise UsafError(
                f"--max-new-tokens must be from 1 to {MAX_NEW_TOKENS:,}, not {self.max_new_tokens}."
            )
        if not self.temperature > 0:
            raise UsafError(f"--temperature must be above 0, not {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise UsafError(f"--top-p must be in (0, 1], not {self.top_p}.")
        if self.top_k < 0:
            raise UsafError(f"--top-k must be 0 (off) or more, not {self.top_k}.")
        if not self.repetition_penalty > 0:
            raise UsafError(f"--repetition-penalty must be above 0, not {self.repetition_penalty}.")
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
        raise UsafError(
            "this model folder has no tokenizer files: usaf generate needs the tokenizer to read prompts and "
            "write text; copy the base's tokenizer files beside it."
        )
    use_chat_template(tokenizer, chat_template_setting)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer, prompt: Prompt, where: str) -> list[int]:
    """The prompt's tokens: a chat rendered by the model's template with the assistant's turn opened."""
    if prompt.messages is None:
        return list(tokenizer(prompt.text)["input_ids"])
    if not has_chat_template(tokenizer):
        raise UsafError(
            f'{where}: a chat prompt, but the model has no chat template; give {{"prompt": "..."}} text, or '
            "a template with --set data.chat_template=FILE.jinja."
        )
    try:
        text = bounded_render(tokenizer, list(prompt.messages), None, add_generation_prompt=True)
    except Exception as err:  # jinja errors, a template's raise_exception(), a bound met
        raise UsafError(f"{where}: the chat template failed: {first_line(err)}") from None
    # the rendered chat carries its own special tokens, as apply_chat_template(tokenize=True) leaves them
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def generate_ids(model, ids: list[int], sampling: Sampling, tokenizer, device, streamer=None) -> list[int]:
    """The new tokens `generate` gives after `ids` (sampling seeded per call: the same prompt, the same text)."""
    if sampling.do_sample:
        torch.manual_seed(sampling.seed)
    inputs = torch.tensor([ids], device=device)
    out = model.generate(
        input_ids=inputs,
        attention_mask=torch.ones_like(inputs),
        streamer=streamer,
        **sampling.arguments(tokenizer),
    )
    return out[0, len(ids) :].tolist()


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)
