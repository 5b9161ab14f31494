"""Assistant-only loss with the stock chat templates of the families usaf trains, as TRL ships them (read from the
installed package, never copied here): every assistant turn's own text and its end-of-turn token supervised,
nothing else; the fallback for templates TRL does not know; message normalization; data.chat_template; and
`usaf data --show`."""

from __future__ import annotations

import json
import re
import string
import time
from pathlib import Path

import pytest
import trl
from helpers import CHAT, supervised
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from usaf.cli import main
from usaf.config import RunConfig
from usaf.data import load_dataset
from usaf.data.records import BadRecord
from usaf.data.templates import check_messages, encode_messages, use_chat_template
from usaf.errors import UsafError
from usaf.testing.tiny import tiny_model
from usaf.train.tokenizer import char_tokenizer

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
DEEPSEEK_TOOLS = [f"<｜{name}｜>" for name in ("tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin")] + [
    f"<｜{name}｜>" for name in ("tool▁call▁end", "tool▁sep", "tool▁outputs▁begin", "tool▁outputs▁end")
]
GLM_ROLES = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
# family: (its special tokens, bos, eos), as the real tokenizers have them
FAMILIES = {
    "qwen3": (
        ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>"],
        None,
        "<|im_end|>",
    ),
    "qwen2_5": (
        ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|endoftext|>"],
        None,
        "<|im_end|>",
    ),
    "gptoss": (
        ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"],
        None,
        "<|return|>",
    ),
    "deepseekv3": (
        [
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            *DEEPSEEK_TOOLS,
        ],
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
    ),
    "glm4moe": (
        [*GLM_ROLES, "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>"],
        None,
        "<|endoftext|>",
    ),
    "llama3": (
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
}
# what the model generates in each assistant turn of CHAT, its end-of-turn token included
EXPECTED = {
    # TRL's training variant renders the (empty) reasoning block in every turn: the model emits it
    "qwen3": ["<think>\n\n</think>\n\n4<|im_end|>\n", "<think>\n\n</think>\n\n6<|im_end|>\n"],
    "qwen2_5": ["4<|im_end|>\n", "6<|im_end|>\n"],
    # <|start|>assistant is the prompt's; an earlier answer ends with <|end|> as the template renders it (as in
    # TRL's training template), the last one with <|return|>
    "gptoss": ["<|channel|>final<|message|>4<|end|>", "<|channel|>final<|message|>6<|return|>"],
    "deepseekv3": ["4<｜end▁of▁sentence｜>", "6<｜end▁of▁sentence｜>"],
    # GLM ends a turn with the next message's role token, the token its generation config stops on
    "glm4moe": ["\n<think></think>\n4<|user|>", "\n<think></think>\n6<|user|>"],
    "llama3": ["4<|eot_id|>", "6<|eot_id|>"],
}
TOOL_CHAT = [
    {"role": "user", "content": "weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "name": "get", "content": "cold"},
    {"role": "assistant", "reasoning_content": "it said cold", "content": "Cold."},
]


def family_tokenizer(family: str, template: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with the family's special tokens and its stock template from TRL."""
    specials, bos, eos = FAMILIES[family]
    stock = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    vocab = {"<unk>": 0}
    for token in [*specials, *sorted(set(string.printable) | set(stock))]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<unk>", *specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token=bos,
        eos_token=eos,
        chat_template=template or stock,
    )


def encode(tokenizer, messages, setting: str = ""):
    use_chat_template(tokenizer, setting)
    return encode_messages({"messages": messages}, tokenizer)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_supervises_the_assistant_turns_and_their_ends_only(family):
    tokenizer = family_tokenizer(family)
    ids, labels = encode(tokenizer, CHAT)
    # TRL's training variant replaced the stock template
    assert re.search(r"\{%-?\s*generation", tokenizer.chat_template) and not re.search(
        r"\{%-?\s*generation", (TEMPLATES / f"{family}.jinja").read_text()
    )
    assert supervised(tokenizer, ids, labels) == EXPECTED[family]
    text = tokenizer.decode(ids)
    assert "Be brief." in text and "and 3+3?" in text  # the prompt is there, unsupervised


def test_qwen3_tool_call_and_thinking():
    tokenizer = family_tokenizer("qwen3")
    ids, labels = encode(tokenizer, TOOL_CHAT)
    call = '<tool_call>\n{"name": "get", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert supervised(tokenizer, ids, labels) == [
        f"<think>\n\n</think>\n\n{call}<|im_end|>\n",
        "<think>\nit said cold\n</think>\n\nCold.<|im_end|>\n",
    ]
    assert "<tool_response>\ncold\n</tool_response>" in tokenizer.decode(ids)


def test_gptoss_channels_earlier_and_final_turns():
    tokenizer = family_tokenizer("gptoss")
    chat = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "thinking": "add", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "thinking": "add again", "content": "6"},
    ]
    ids, labels = encode(tokenizer, chat)
    assert supervised(tokenizer, ids, labels) == [
        # earlier turn: its analysis is dropped from history; its answer and <|end|> are supervised
        "<|channel|>final<|message|>4<|end|>",
        # final turn: analysis ends with <|end|> and the model opens the final message itself
        "<|channel|>analysis<|message|>add again<|end|><|start|>assistant<|channel|>final<|message|>6<|return|>",
    ]


def test_gptoss_tool_call_ends_with_call():
    tokenizer = family_tokenizer("gptoss")
    ids, labels = encode(tokenizer, TOOL_CHAT)
    pieces = supervised(tokenizer, ids, labels)
    assert pieces[0] == ' to=functions.get<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    assert pieces[1].endswith("<|channel|>final<|message|>Cold.<|return|>")


def test_deepseek_tool_outputs_end_is_the_prompts():
    tokenizer = family_tokenizer("deepseekv3")
    ids, labels = encode(tokenizer, TOOL_CHAT)
    pieces = supervised(tokenizer, ids, labels)
    assert pieces[0].startswith("<｜tool▁calls▁begin｜>") and pieces[0].endswith("<｜end▁of▁sentence｜>")
    assert pieces[1] == "Cold.<｜end▁of▁sentence｜>"


# ---- the fallback: templates without markers that TRL does not know (here: the stock ones, TRL bypassed) ----------


@pytest.mark.parametrize(
    ("family", "messages", "expected"),
    [
        ("deepseekv3", CHAT[:3], ["4<｜end▁of▁sentence｜>"]),  # failed even for one turn
        ("qwen3", TOOL_CHAT, None),  # failed on the tool-call turn
        ("glm4moe", CHAT, ["\n<think></think>\n4<|user|>", "\n<think></think>\n6"]),  # never taught to stop
        ("llama3", CHAT, EXPECTED["llama3"]),
        ("qwen2_5", CHAT, EXPECTED["qwen2_5"]),
    ],
)
def test_fallback_on_stock_templates(family, messages, expected):
    tokenizer = family_tokenizer(family)  # use_chat_template not called: the stock template as it is
    ids, labels = encode_messages({"messages": messages}, tokenizer)
    if expected is None:  # Qwen3's own: the earlier turn without a reasoning block, the last one with it
        call = '<tool_call>\n{"name": "get", "arguments": {"city": "Oslo"}}\n</tool_call>'
        expected = [f"{call}<|im_end|>\n", "<think>\nit said cold\n</think>\n\nCold.<|im_end|>\n"]
    assert supervised(tokenizer, ids, labels) == expected


def test_fallback_with_reasoning_the_template_drops_from_earlier_turns():
    tokenizer = family_tokenizer("qwen3")  # Qwen3's own template: earlier turns lose their reasoning
    chat = [
        CHAT[1],
        {**CHAT[2], "reasoning_content": "sum"},
        CHAT[3],
        {**CHAT[4], "reasoning_content": "again"},
    ]
    ids, labels = encode_messages({"messages": chat}, tokenizer)
    assert supervised(tokenizer, ids, labels) == [
        "4<|im_end|>\n",
        "<think>\nagain\n</think>\n\n6<|im_end|>\n",
    ]


def test_the_fallback_refuses_what_it_cannot_locate():
    # gpt-oss's own template closes the last answer with <|return|> and earlier ones with <|end|>: without markers
    # the turn cannot be matched, and the record is refused rather than masked wrongly
    with pytest.raises(BadRecord, match=r"cannot locate assistant turn messages\[2\].*data\.chat_template"):
        encode_messages({"messages": CHAT}, family_tokenizer("gptoss"))


def test_fallback_on_a_mixtral_style_template():
    # Mixtral's template ships with neither TRL nor transformers; one of its shape (roles must alternate, the
    # assistant turn ends with eos) goes through the fallback
    tokenizer = char_tokenizer()
    tokenizer.chat_template = (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
    )
    ids, labels = encode_messages({"messages": CHAT[1:]}, tokenizer)
    assert supervised(tokenizer, ids, labels) == ["4<eos>", "6<eos>"]
    with pytest.raises(BadRecord, match=r"^the chat template failed: Conversation roles must alternate"):
        encode_messages({"messages": CHAT}, tokenizer)  # its system turn


# ---- messages -----------------------------------------------------------------------------------------------------


def test_messages_are_normalized_for_the_templates():
    record = {
        "messages": [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            },
            {"role": "user", "content": "hi", "id": 7, "timestamp": "now"},
            {"role": "assistant", "thinking": "greet", "content": "hello", "weight": 1},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
        ]
    }
    messages, tools = check_messages(record)
    assert tools is None
    assert messages[0] == {"role": "developer", "content": "Be brief."}
    assert messages[1] == {"role": "user", "content": "hi"}  # unknown keys dropped
    assert messages[2] == {
        "role": "assistant",
        "content": "hello",
        "reasoning_content": "greet",
        "thinking": "greet",
    }
    assert messages[3]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ]


def test_a_conversation_of_too_many_turns_is_refused_at_once():
    tokenizer = family_tokenizer("qwen2_5")
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 5_000
    began = time.monotonic()
    with pytest.raises(BadRecord, match="10,000 turns; usaf encodes at most 512"):
        encode(tokenizer, turns)
    assert time.monotonic() - began < 1


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "user", "content": [{"type": "image", "url": "x"}]}, r"content\[0\] is a 'image' part"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "not valid JSON",
        ),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "needs a function name"),
        ({"role": "assistant", "content": "x", "thinking": "a", "reasoning_content": "b"}, "not both"),
        ({"role": "narrator", "content": "x"}, "has role 'narrator'"),
    ],
)
def test_bad_messages_are_one_line(message, error):
    with pytest.raises(BadRecord, match=error):
        check_messages({"messages": [{"role": "user", "content": "q"}, message]})


def test_the_developer_role_becomes_system_where_the_template_has_none():
    qwen3 = family_tokenizer("qwen3")
    ids, _ = encode(qwen3, [{"role": "developer", "content": "Be brief."}, *CHAT[1:3]])
    assert qwen3.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    gptoss = family_tokenizer("gptoss")
    ids, _ = encode(gptoss, [{"role": "developer", "content": "Be brief."}, *CHAT[1:3]])
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in gptoss.decode(ids)


# ---- data.chat_template -------------------------------------------------------------------------------------------


def test_data_chat_template_by_name_and_by_file(tmp_path):
    tokenizer = family_tokenizer("qwen2_5")
    tokenizer.chat_template = None
    ids, labels = encode(tokenizer, CHAT, "chatml")
    assert supervised(tokenizer, ids, labels) == EXPECTED["qwen2_5"]
    path = tmp_path / "mine.jinja"
    path.write_text(
        (TEMPLATES / "llama3.jinja").read_text() + "\n"
    )  # a copy with a trailing newline is matched
    llama = family_tokenizer("llama3")
    llama.chat_template = None
    ids, labels = encode(llama, CHAT, str(path))
    assert supervised(llama, ids, labels) == EXPECTED["llama3"]


@pytest.mark.parametrize(
    ("setting", "error"),
    [("qwen9", r"qwen9: not a template name; .*chatml, .*llama3, .*qwen3"), ("nope/t.jinja", "no such file")],
)
def test_an_unknown_chat_template_is_named_with_the_choices(setting, error):
    with pytest.raises(UsafError, match=error):
        use_chat_template(char_tokenizer(), setting)


def test_a_template_with_a_syntax_error_is_one_line(tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}")
    with pytest.raises(UsafError, match=r"broken\.jinja: not a valid Jinja template"):
        use_chat_template(char_tokenizer(), str(path))


def test_load_run_data_applies_the_setting(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    config = RunConfig.load(None, [f"data.train={data}", "data.chat_template=llama3", "data.eval_fraction=0"])
    tokenizer = family_tokenizer("llama3")
    tokenizer.chat_template = None
    from usaf.data import load_run_data

    train, _, _ = load_run_data(config.data, config.model, config.train, tokenizer, pack=False)
    row = train[0]
    assert supervised(tokenizer, row["input_ids"].tolist(), row["labels"].tolist()) == EXPECTED["llama3"]
    # the same file through load_dataset without the setting: no template, so the record is refused
    bare = family_tokenizer("llama3")
    bare.chat_template = None
    with pytest.raises(UsafError, match="need a tokenizer with a chat template"):
        load_dataset([str(data)], bare, 256, eval_fraction=0)


def test_a_chat_template_file_is_made_absolute_with_the_runs_other_paths(tmp_path, monkeypatch):
    from usaf.train.session import absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.jinja").write_text("{{ messages }}")
    config = RunConfig.load(None, ["data.chat_template=mine.jinja"])
    assert absolute_paths(config).data.chat_template == str(tmp_path / "mine.jinja")
    config = RunConfig.load(None, ["data.chat_template=qwen3"])
    assert absolute_paths(config).data.chat_template == "qwen3"


# ---- usaf data --show ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny model folder per family, with the family's tokenizer and stock template."""
    root = tmp_path_factory.mktemp("models")
    model = None
    folders = {}
    for family in sorted(FAMILIES):
        tokenizer = family_tokenizer(family)
        folder = root / family
        if model is None or model.config.vocab_size < len(tokenizer):
            model = tiny_model("qwen3_moe", vocab_size=max(len(family_tokenizer(f)) for f in FAMILIES))
            model.config.max_position_embeddings = 512  # the families' chats (gpt-oss's over 64 tokens) fit
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[family] = folder
    return folders


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_usaf_data_json_shows_what_training_gets(family, model_dirs, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": CHAT}) + "\n" + json.dumps({"prompt": "a", "completion": "b"}) + "\n"
    )
    assert (
        main(["data", "--model", str(model_dirs[family]), "--data", str(data), "--show", "1", "--json"]) == 0
    )
    out, err = capsys.readouterr()
    [line] = out.splitlines()
    row = json.loads(line)
    tokenizer = family_tokenizer(family)
    assert supervised(tokenizer, row["input_ids"], row["labels"]) == EXPECTED[family]
    assert err.startswith("data: 2 records")


def test_usaf_data_json_qwen3_with_a_system_prompt_a_tool_call_and_thinking(model_dirs, tmp_path, capsys):
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."}, *TOOL_CHAT]}) + "\n")
    assert (
        main(["data", "--model", str(model_dirs["qwen3"]), "--data", str(data), "--show", "1", "--json"]) == 0
    )
    row = json.loads(capsys.readouterr().out)
    tokenizer = family_tokenizer("qwen3")
    call = '<tool_call>\n{"name": "get", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert supervised(tokenizer, row["input_ids"], row["labels"]) == [
        f"<think>\n\n</think>\n\n{call}<|im_end|>\n",
        "<think>\nit said cold\n</think>\n\nCold.<|im_end|>\n",
    ]
    assert "Be brief." in tokenizer.decode(row["input_ids"])


def test_usaf_data_marks_the_supervised_text(model_dirs, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    assert main(["data", "--model", str(model_dirs["llama3"]), "--data", str(data), "--show", "5"]) == 0
    out = capsys.readouterr().out
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n[[4<|eot_id|>]]<|start_header_id|>user" in out
    assert out.count("--- record") == 1 and out.rstrip().splitlines()[-1].startswith("data: 1 records")


def test_usaf_data_bad_input_is_one_line(model_dirs, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    folder = str(model_dirs["qwen3"])
    assert main(["data", "--model", folder, "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usaf: error: {data}:1: 'messages' has no assistant turn") and err.count("\n") == 1
    assert main(["data", "--model", folder, "--data", str(data), "--set", "data.chat_template=qwen9"]) == 2
    assert "data.chat_template=qwen9: not a template name" in capsys.readouterr().err
