"""Training data, by stage: sources (files, save_to_disk folders, hub ids -> raw records) -> shapes (alpaca,
sharegpt, messages, prompt/completion, preference, text, token ids -> usaf's record kinds) -> records / templates
(encoders) -> tokenize (documents with loss masks through datasets.map, cached; windows or truncation) -> mix
(data.weights) -> pack (rows) -> batches; load_dataset runs them all. stream: the same encoders over a
datasets.IterableDataset, as batches are taken (data.streaming).

Public API
  load_dataset(paths, tokenizer, max_seq_len, pack=True, skip_bad_records=False, eval_paths=None,
               eval_fraction=0.05, seed=0, split="train", columns=None, long_documents="split", stride=0,
               num_proc=None) -> (train, eval | None, DataStats)
      The one entry point. `eval` is None only when no eval file is given and eval_fraction == 0.
  load_run_data(data, model, train, tokenizer, pack, files=None, held_out=True)
      load_dataset with a run's sections (data; model.path, train.seed and train.objective), for train, eval
      and select.
  TokenizedDataset   the rows to train on; dataset[i] -> {"input_ids", "labels", "position_ids"} (1-D int64)
  Batches(dataset, batch_size, seed=0, shuffle=True, epochs=None)
      Seeded batch iterator with state_dict() / load_state_dict() for exact resume.
  collate(rows, pad_id) -> batch dict of [batch, seq] tensors
  DataStats          what was read, skipped, truncated, windowed and packed, and notes; .summary() is one line
  IGNORE_INDEX       -100, the label of positions without loss

Sources (see usaf.data.sources)
  .jsonl/.ndjson  one JSON record per line (blank lines ignored); errors name `file:LINE`.
  .json           a list of records, or {"data": [records]}; errors name `file[INDEX]` (0-based).
  .txt/.md        one {"text"} document per blank-line-separated block (a whole file with no blank lines is
                  one document); errors name `file:LINE` of the block's first line.
  .csv/.tsv/.parquet/.arrow, save_to_disk folders (a DatasetDict's split: data.split or NAME:SPLIT), hub ids
                  (from the local caches first; else downloaded by datasets.load_dataset, unless
                  HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set): read by `datasets`; errors name
                  `file:row N` (N: the row's 0-based index); nulls count as absent, so files mixing shapes work.
  Any file may be compressed (.gz, .bz2, .xz, .zst). data.columns renames source columns to usaf's keys.

Records (see usaf.data.shapes for the shapes brought to these kinds; unused keys are named in a note)
  {"text"}                    loss on every token but the first.
  {"messages", ["tools"]}     chat rendered with the chat template (data.chat_template, else the tokenizer's;
                              see usaf.data.templates); loss on what the model generates in assistant turns,
                              their end-of-turn token included. Roles: system, developer, user, assistant,
                              tool. Content: a string or a list of text parts. Messages may also carry name,
                              tool_calls (OpenAI's shape), tool_call_id, reasoning_content or thinking; other
                              message keys are dropped.
  {"prompt", "completion"}    plain concatenation (no chat template); loss on the completion only. Both lists of
                              messages: one conversation, loss on the completion's assistant turns only.
  {"input_ids", ["labels"]}   used as given (no BOS/EOS added); labels default to input_ids, must be aligned
                              with input_ids (equal to it where supervised, -100 elsewhere): never shifted.

Tokenization: text and prompts are encoded with the tokenizer's own special tokens (e.g. BOS); EOS is appended
to texts and completions so the model learns to stop. Labels are aligned with input_ids, as transformers
expects: the model (or usaf.engine.loss) shifts them, so the target of position t is token t+1. The first label of
every document is -100: nothing inside the document predicts it, and in a packed row it would otherwise be
the target of the previous document's last token. Texts over 64 k characters are tokenized in pieces cut
before a whitespace (bounded memory; see usaf.data.records); a record that is truncated has its texts cut before
tokenizing, past what its first max_seq_len tokens can span (records.TextLimit). Chat templates render within
bounds of output, time, loops and value sizes (usaf.data.render). Tokenized rows are cached in the datasets cache (see
usaf.data.tokenize).

Long records (more than max_seq_len tokens), long_documents=split: text and token-id records become windows of
max_seq_len tokens; each continuation window starts with max(stride, 1) tokens of the one before as context
(labels -100), so every token is a target exactly once. Chat and prompt/completion records are truncated instead
(a window without its prompt would teach answers without questions), as everything is with
long_documents=truncate: the first max_seq_len tokens are kept. Both are counted in DataStats, never silent. A
record left with no supervised token is an error (or skipped, with skip_bad_records), as is a preference pair
whose two documents are the same (DPO's loss ln 2, no gradient). load_run_data first clamps data.max_seq_len to
the model's max_position_embeddings (load.fit_context, one note), for every objective and command.

Packing (pack=True): best-fit decreasing, deterministic, documents never split. position_ids restart at 0 for
every document. transformers 5.x turns such position_ids into a block-diagonal causal mask (documents do not
attend to each other) only when attention_mask is None AND no cache is built, so batches carry no
attention_mask and the model must be called with use_cache=False (config.use_cache is usually True, and a
cache object disables the packed-sequence detection). Padding is on the right, with labels -100 and
position_ids restarting at 0 (a segment of its own); causal attention never lets real tokens see it, so no
attention_mask is needed for padding either. Models whose decoder does not pass position_ids to the mask
functions (gpt_oss in transformers 5.24) need pack=False or an explicit mask.

Held-out split (no eval_paths, eval_fraction > 0): whole records (all windows of one on the same side), seeded,
before packing, at least one.
"""

from usaf.data.batches import Batches, collate
from usaf.data.load import load_dataset, load_run_data
from usaf.data.pack import TokenizedDataset
from usaf.data.tokenize import DataStats
from usaf.engine.loss import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "Batches",
    "DataStats",
    "TokenizedDataset",
    "collate",
    "load_dataset",
    "load_run_data",
]
