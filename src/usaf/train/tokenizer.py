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

`char_tokenizer(llama_vocab=True)` encodes and decodes exactly the same, with the same ids, but writes the space as
SentencePiece's "▁" and marks the BPE byte-fallback: the layout llama.cpp's `convert_hf_to_gguf.py` reads as a
Llama vocabulary for the Llama-family models (Mixtral), which needs no known pre-tokenizer. (The converter takes a
GPT-2-style vocabulary only for other families, e.g. qwen3_moe, and only when the tokens of a test string hash to
one of the published tokenizers it lists, which no small vocabulary does.)
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, processors
from transformers import PreTrainedTokenizerFast

from usaf.errors import ConfigError, ModelError, UsafError, first_line
from usaf.model.hf import load_config, text_config

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


SPACE = "\u2581"  # SentencePiece's space


def char_tokenizer(alphabet: str | None = None, llama_vocab: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a chat template; `alphabet` defaults to printable ASCII + newline;
    `llama_vocab` spells it as a Llama (SentencePiece-style) vocabulary, same ids (see the module's text)."""
    alphabet = DEFAULT_ALPHABET if alphabet is None else alphabet
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise ConfigError("char_tokenizer: the alphabet must be a non-empty string of distinct characters.")
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + ROLE_TOKENS)}
    for char in alphabet:
        vocab[SPACE if llama_vocab and char == " " else char] = len(vocab)

    # BPE without merges is exactly one token per character, and encodes ~2.5x faster than WordLevel over a
    # one-character split.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=llama_vocab))
    backend.decoder = decoders.Fuse()  # join the characters back without separators
    if llama_vocab:
        # no <0xNN> tokens: a character outside the alphabet stays <unk>, as in the plain layout
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
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
        # said in tokenizer_config.json, so that llama.cpp does not put a space before the text as SentencePiece does
        **({"add_prefix_space": False} if llama_vocab else {}),
    )


# Files any transformers tokenizer is loaded from; a model folder with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tekken.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def has_tokenizer_files(folder) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


class NoTokenizer:
    """What a model folder without tokenizer files gets instead of transformers' empty tokenizer (which would
    claim a vocabulary of 1): pre-tokenized records are checked against the model's vocabulary
    (config.vocab_size); encoding text says, in one sentence, that the folder has no tokenizer."""

    missing = True
    chat_template = None
    is_fast = False

    def __init__(self, folder: str, vocab_size: int, pad_token_id=None, eos_token_id=None, bos_token_id=None):
        self.folder, self.vocab_size = str(folder), int(vocab_size)
        self.pad_token_id, self.eos_token_id, self.bos_token_id = pad_token_id, eos_token_id, bos_token_id
        self.vocabulary = f"the model's vocabulary of {self.vocab_size} (config.vocab_size)"

    def __len__(self) -> int:
        return self.vocab_size

    def needs_tokenizer(self, where: str, kind: str) -> UsafError:
        return ModelError(
            f"{where}: '{kind}' records need a tokenizer, and the model folder {self.folder} has no tokenizer "
            f"files ({', '.join(TOKENIZER_FILES[:2])}); copy the tokenizer's files into it, or give "
            "pre-tokenized {'input_ids'} records."
        )

    def __call__(self, *args, **kwargs):
        raise self.needs_tokenizer(self.folder, "text")

    def apply_chat_template(self, *args, **kwargs):
        raise self.needs_tokenizer(self.folder, "messages")


def model_vocabulary(folder: str) -> NoTokenizer:
    """The NoTokenizer of a model folder, from its config.json."""
    try:
        config = load_config(folder)
    except UsafError:
        raise
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"cannot read {folder}/config.json: {first_line(err)}") from None
    text = text_config(config)
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ModelError(
            f"{folder}/config.json has no vocab_size and the folder has no tokenizer files; copy the "
            "tokenizer's files into it."
        )
    ids = {k: getattr(text, k, None) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    ids = {k: (v[0] if isinstance(v, list) and v else v) for k, v in ids.items()}
    return NoTokenizer(folder, vocab, **{k: v if isinstance(v, int) else None for k, v in ids.items()})
