"""GRPO's data (`train.objective=grpo`): records with a `prompt`, a text or chat messages as TRL's GRPOTrainer takes
them, from any source `--data` takes. Each record is kept whole beside its tokens: its other columns are the reward
functions' keyword arguments (`usaf.train.grpo`).

A prompt's tokens are the ones TRL generates after: a text with the tokenizer's special tokens, messages through
the chat template with the assistant's turn opened. A row's labels are its tokens, so that calibration chooses the
entries to train by the gradients of the prompts (the completions do not exist before training starts).
"""

from __future__ import annotations

from usaf.config.sections import DataSection
from usaf.data import DataStats, TokenizedDataset
from usaf.data.records import BadRecord
from usaf.data.sources import open_source
from usaf.data.templates import bounded_render, check_chat_support, use_chat_template
from usaf.data.tokenize import Documents, parse_record
from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import DataError, first_line


class PromptRows(TokenizedDataset):
    """One row per prompt (never packed: a row is a record), `records[i]` the record row i came from."""

    def __init__(self, documents: Documents, records: list[dict], max_seq_len: int, pad_id: int):
        super().__init__(documents, max_seq_len, pack=False, pad_id=pad_id)
        self.records = records


def read_records(names: list[str], split: str) -> list[tuple[str, dict]]:
    """(where, record) for every record of the sources `names`, each a JSON object with a 'prompt'."""
    found = []
    for name in names:
        source = open_source(str(name), split)
        for index, row in enumerate(source.rows):
            where = row["where"] if source.located else f"{source.name}:row {index}"
            try:
                if source.located and row["bad"]:
                    raise BadRecord(row["bad"])
                record = parse_record(row["json"]) if source.located else dict(row)
            except BadRecord as problem:
                raise DataError(f"{where}: {problem}") from None
            if not isinstance(record, dict) or record.get("prompt") in (None, "", []):
                raise DataError(
                    f"{where}: train.objective=grpo trains on records with a 'prompt' (a text or chat messages); "
                    "its completions are generated"
                )
            found.append((where, record))
    return found


def prompt_ids(tokenizer, prompt, where: str) -> list[int]:
    """The tokens generation starts from, as TRL's GRPOTrainer makes them."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    check_chat_support(tokenizer, where)
    try:
        text = bounded_render(tokenizer, list(prompt), None, add_generation_prompt=True)
    except Exception as err:  # jinja errors, a template's raise_exception(), a bound met
        raise DataError(f"{where}: the chat template failed: {first_line(err)}") from None
    # the rendered chat carries its own special tokens, as apply_chat_template(tokenize=True) leaves them
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_prompts(data: DataSection, tokenizer, files: list[str] | None = None):
    """The prompts of `files` (data.train by default) as (PromptRows, None, DataStats): GRPO has no held-out
    loss to evaluate. A prompt must leave data.max_seq_len room for a completion."""
    use_chat_template(tokenizer, data.chat_template)
    records = read_records(list(files if files is not None else data.train), data.split)
    if not records:
        raise DataError(f"the data set is empty: no prompts in {', '.join(map(str, data.train))}.")
    documents = Documents()
    for where, record in records:
        ids = prompt_ids(tokenizer, record["prompt"], where)
        if len(ids) >= data.max_seq_len:
            raise DataError(
                f"{where}: the prompt is {len(ids)} tokens, and data.max_seq_len={data.max_seq_len} leaves no room "
                "for its completion; shorten it or raise data.max_seq_len."
            )
        documents.ids.append(ids)
        documents.labels.append([IGNORE_INDEX, *ids[1:]])  # a document's first token is never a target
        documents.records.append(where)
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    rows = PromptRows(documents, [record for _, record in records], data.max_seq_len, pad_id)
    stats = DataStats(records=len(records), max_seq_len=data.max_seq_len, train_documents=len(rows))
    stats.train_sequences, stats.train_supervised_tokens = len(rows), rows.supervised_tokens
    stats.notes.append(f"grpo: {len(rows):,} prompts; their completions are generated at each step")
    return rows, None, stats
