"""A deterministic character-level tokenizer, built locally, for tests and the bundled demo (no downloads).

Vocabulary (ids are stable for a given alphabet):
  0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>                      special tokens
  4 <|system|>, 5 <|user|>, 6 <|assistant|>, 7 <|tool|>   role markers, one special token each
  8 ...                                                   one token per character of the alphabet
The default alphabet is printable ASCII (space to '~') plus newline: 104 tokens in all. Any other character
becomes <unk>. Encoding with special tokens prepends <bos> (like Llama-style tokenizers); nothing appends
<eos>, that is the data pipeline's job.

The chat template renders `<bos>` and then, for each message, its role marker, its content and `<eos>` as the
end of the turn, so a model trained on it stops by itself. Assistant turns are wrapped in `{% generation %}`
markers, so `apply_chat_template(..., return_assistant_tokens_mask=True)` works.
With `add_generation_prompt=True` the rendering ends with `<|assistant|>`.

It is a `PreTrainedTokenizerFast` and round-trips through `save_pretrained` / `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

from .errors import UsafError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
DEFAULT_ALPHABET = "".join(chr(code) for code in range(32, 127)) + "\n"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer(alphabet: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a chat template; `alphabet` defaults to printable ASCII + newline."""
    alphabet = DEFAULT_ALPHABET if alphabet is None else alphabet
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise UsafError("char_tokenizer: the alphabet must be a non-empty string of distinct characters.")
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + ROLE_TOKENS)}
    for char in alphabet:
        vocab[char] = len(vocab)

    # BPE without merges is exactly one token per character, and encodes ~2.5x faster than WordLevel over a
    # one-character split.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # join the characters back without separators
    backend.add_special_tokens(list(SPECIAL_TOKENS + ROLE_TOKENS))
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
    )
