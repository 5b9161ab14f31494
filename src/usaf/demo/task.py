"""The bundled demo's task: word transformations on random lowercase letter strings.

Each record is `{"prompt": "<kind>: <word> -> ", "completion": <transformed word>}`; fed through usaf.data as a
prompt/completion record it becomes `<bos> prompt completion <eos>`, with loss on the completion only.

Kinds
  copy    kqzm -> kqzm     }  the pretraining skills of the demo model (scripts/make_demo_model.py): its
  upper   kqzm -> KQZM     }  attention learned to fetch the aligned source character and to read the task
  shift   kqzm -> lran        the NEW skill (Caesar +1, z -> a). Nothing in pretraining maps a letter to its
                              successor, so the pretrained model scores ~0 %; the attention pattern is the
                              same as copy's, so training only the experts' FFN weights (+ routers) can learn
                              it: a per-character lookup is what an FFN stores well.

Public API
  KINDS, PRETRAIN_KINDS, NEW_SKILL
  make_examples(kind, n, seed) -> list of {"prompt", "completion"}   deterministic for (kind, n, seed)
  write_demo_data(directory, train_size=..., eval_size=...) -> {"train", "eval", "preference_train",
                                                                 "preference_eval": path}
  preference_pairs(records) -> {"prompt", "chosen": the shifted word, "rejected": the copied word}
  read_jsonl(path) -> records
  task_accuracy(model, tokenizer, records, max_new_tokens=None, batch_size=64) -> exact-match share in [0, 1]
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from pathlib import Path

import torch

from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import ConfigError, DataError

LETTERS = string.ascii_lowercase
MIN_WORD_LEN, MAX_WORD_LEN = 3, 6

_SHIFT_TABLE = str.maketrans(LETTERS, LETTERS[1:] + LETTERS[:1])
TRANSFORMS: dict[str, Callable[[str], str]] = {
    "copy": lambda word: word,
    "upper": str.upper,
    "shift": lambda word: word.translate(_SHIFT_TABLE),
}
KINDS = tuple(TRANSFORMS)
PRETRAIN_KINDS = ("copy", "upper")
NEW_SKILL = "shift"

# Seeds of the bundled files; the eval split draws from its own stream and drops any prompt seen in train.
DEMO_TRAIN_SEED, DEMO_EVAL_SEED = 1, 2
DEMO_TRAIN_SIZE, DEMO_EVAL_SIZE = 2000, 200
PREFERENCE_TRAIN_SIZE = 500  # the demo's preference set: a small one, as preference data usually is


def prompt_for(kind: str, word: str) -> str:
    return f"{kind}: {word} -> "


def make_examples(kind: str, n: int, seed: int) -> list[dict]:
    """`n` records of `kind` on random words of 3-6 lowercase letters; the same (kind, n, seed), the same list."""
    if kind not in TRANSFORMS:
        raise ConfigError(f"Unknown demo task kind {kind!r}; known kinds: {list(KINDS)}.")
    # A string seed is hashed with SHA-512 by `random`: stable across runs, platforms and Python versions.
    rng = random.Random(f"usaf-demo/{kind}/{seed}")
    records = []
    for _ in range(n):
        word = "".join(rng.choices(LETTERS, k=rng.randint(MIN_WORD_LEN, MAX_WORD_LEN)))
        records.append({"prompt": prompt_for(kind, word), "completion": TRANSFORMS[kind](word)})
    return records


def demo_splits(
    kind: str = NEW_SKILL, train_size: int = DEMO_TRAIN_SIZE, eval_size: int = DEMO_EVAL_SIZE
) -> tuple[list[dict], list[dict]]:
    """The train and eval records of `kind`; no eval prompt occurs in train (held-out words)."""
    train = make_examples(kind, train_size, DEMO_TRAIN_SEED)
    seen = {r["prompt"] for r in train}
    evaluation: list[dict] = []
    batch_seed = DEMO_EVAL_SEED
    while len(evaluation) < eval_size:  # short words can collide with train; draw more until enough
        for record in make_examples(kind, eval_size, batch_seed):
            if record["prompt"] not in seen and len(evaluation) < eval_size:
                seen.add(record["prompt"])
                evaluation.append(record)
        batch_seed += 1000
    return train, evaluation


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def preference_pairs(records: list[dict]) -> list[dict]:
    """The new skill as preferences: the shifted word chosen over the copied one (what the pretrained model does)."""
    pairs = []
    for record in records:
        word = record["prompt"].split(": ", 1)[1].removesuffix(" -> ")
        pairs.append({"prompt": record["prompt"], "chosen": record["completion"], "rejected": word})
    return pairs


def write_demo_data(
    directory: str | Path, train_size: int = DEMO_TRAIN_SIZE, eval_size: int = DEMO_EVAL_SIZE
) -> dict[str, Path]:
    """Write train.jsonl and eval.jsonl of the new skill into `directory`, and the same as preference pairs
    (preference_train.jsonl, the first PREFERENCE_TRAIN_SIZE, and preference_eval.jsonl); returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, evaluation = demo_splits(NEW_SKILL, train_size, eval_size)
    return {
        "train": write_jsonl(directory / "train.jsonl", train),
        "eval": write_jsonl(directory / "eval.jsonl", evaluation),
        "preference_train": write_jsonl(
            directory / "preference_train.jsonl", preference_pairs(train[:PREFERENCE_TRAIN_SIZE])
        ),
        "preference_eval": write_jsonl(directory / "preference_eval.jsonl", preference_pairs(evaluation)),
    }


def encode_records(tokenizer, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """`<bos> prompt completion <eos>`, right-padded; labels only on the completion and <eos> (as usaf.data)."""
    rows, labels = [], []
    for r in records:
        prompt = tokenizer(r["prompt"], add_special_tokens=True)["input_ids"]
        completion = tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        rows.append(prompt + completion)
        labels.append([IGNORE_INDEX] * len(prompt) + completion)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    # Right padding needs no attention mask: causal attention never lets a real token see a later pad.
    input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    label_ids = torch.tensor([row + [IGNORE_INDEX] * (width - len(row)) for row in labels])
    return input_ids, label_ids


@torch.no_grad()
def greedy_completions(
    model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 64
) -> list[str]:
    """Greedy (argmax) continuations of `prompts`, each cut at the first <eos>.

    Prompts are grouped by token length, so batches need no padding (and no attention mask subtleties).
    """
    eos = tokenizer.eos_token_id
    encoded = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    by_length: dict[int, list[int]] = {}
    for index, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(index)
    device = next(model.parameters()).device
    outputs = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        for indices in by_length.values():
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                input_ids = torch.tensor([encoded[i] for i in chunk], device=device)
                generated = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                )[:, input_ids.shape[1] :].tolist()
                for i, tokens in zip(chunk, generated, strict=True):
                    if eos in tokens:
                        tokens = tokens[: tokens.index(eos)]
                    # special tokens stay in the text, so a stray <pad>/<unk> makes the answer wrong
                    outputs[i] = tokenizer.decode(tokens, skip_special_tokens=False)
    finally:
        model.train(was_training)
    return outputs


def task_accuracy(
    model, tokenizer, records: list[dict], max_new_tokens: int | None = None, batch_size: int = 64
) -> float:
    """Share of records whose greedy completion equals `completion` exactly (after <eos>, nothing counts).

    max_new_tokens defaults to the longest completion in tokens plus one (room for the <eos>; a model that
    does not stop by then answered something longer, hence wrong).
    """
    if not records:
        raise DataError("task_accuracy needs at least one record.")
    if max_new_tokens is None:
        max_new_tokens = 1 + max(
            len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) for r in records
        )
    answers = greedy_completions(model, tokenizer, [r["prompt"] for r in records], max_new_tokens, batch_size)
    return sum(a == r["completion"] for a, r in zip(answers, records, strict=True)) / len(records)
