"""Issue 35: a user's first hour, as the README and the docs tell it, run on every change (issue 48: the docs too).

Every command line in the code blocks of README.md, of every `docs/*.md` and of bench/README.md (`DOCS`, in that
order: the README's walk-through makes the run later pages use) is either run here, in the order the pages give,
in one scratch folder that holds what the pages presume the user has (`my.jsonl`, `prompts.jsonl`, `examples/`),
with the bundled model standing in for the user's; or it belongs to another tool and is named in `OTHER_TOOLS` with
where it is checked. A command a page gains that this test does not know fails it, and so does a page of docs/ that
`DOCS` does not list. Every Python snippet runs as it is written, with the bundled model for its placeholder path,
so a snippet with an undefined name fails too. A command shown with its output (`$ usaf plan ...`) must print the
lines shown. The command table's rows (docs/cli.md) run too, each form of each row."""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fake_llama_cpp
from safetensors.torch import load_file

from usaf.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# every page whose code blocks the walk runs, in the walk's order (docs/ whole: test_docs_lists_every_page)
DOCS = [
    README,
    *(ROOT / "docs" / f"{name}.md" for name in (
        "cli", "python", "memory", "simulate", "distributed", "how-it-works", "families", "guarantees",
        "development", "README",
    )),
    ROOT / "bench" / "README.md",
]  # fmt: skip
BUNDLED = ROOT / "src" / "usaf" / "demo_assets"
MODEL_PLACEHOLDER = "path/to/moe-model"  # the README's snippets' stand-in for the user's model
FAST = ["schedule.max_steps=2", "schedule.grad_accum=1", "schedule.warmup_steps=0", "log.progress=false"]
OTHER_TOOLS = {  # first word of a documented command that is not usaf's -> where that path is checked
    "make": "the Makefile's own targets: `make test` is CI; `make demo` runs `usaf demo` (test_make_demo_runs)",
    "vllm": "serving a merged export: the export tests check the layout transformers and vLLM load",
    "llama-server": "serving a GGUF: llama.cpp's own tool, on the GGUF the walk-through writes",
    "accelerate": "tests/distributed/test_trainer_ddp.py runs examples/hf_trainer.py under accelerate launch",
    "ACCELERATE_USE_CPU=1": "tests/distributed/test_trainer_ddp.py (gloo on CPUs)",
    "torchrun": "tests/distributed/test_trainer_ddp.py, test_data_parallel.py, test_expert_parallel_train.py and "
    "test_rank_faults.py run it (docs/distributed.md's multi-node lines: torchrun's own rendezvous, no host here)",
}


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block, and ("indented", lines) of every block indented by four spaces
    after a blank line."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append((line[3:].strip(), lines[i + 1 : end]))
            i = end + 1
            continue
        if line.startswith("    ") and i > 0 and not lines[i - 1].strip():
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            blocks.append(("indented", [x[4:] for x in lines[i:end] if x.strip()]))
            i = end
            continue
        i += 1
    return blocks


def strip_comment(line: str) -> str:
    return re.split(r"\s+#\s", line, maxsplit=1)[0].strip()


def page(path: Path) -> str:
    return str(path.relative_to(ROOT))


def joined(lines: list[str]) -> list[str]:
    """A block's lines with shell continuations (a line ending in a backslash) joined to the next."""
    out: list[str] = []
    for line in lines:
        if out and out[-1].endswith("\\"):
            out[-1] = out[-1][:-1].rstrip() + " " + line.strip()
        else:
            out.append(line)
    return out


def page_commands(path: Path) -> list[tuple[str, list[str]]]:
    """Each command of one page's non-Python code blocks, with the output lines shown after it (`$ cmd`)."""
    commands: list[tuple[str, list[str]]] = []
    for lang, lines in code_blocks(path.read_text()):
        if lang not in ("", "indented", "bash", "sh", "shell", "console"):  # python, yaml, text: not commands
            continue
        lines = joined(lines)
        if any(x.startswith("$ ") for x in lines):  # a transcript: commands and what they print
            block: list[tuple[str, list[str]]] = []
            for x in lines:
                if x.startswith("$ "):
                    block.append((strip_comment(x[2:]), []))
                elif block and x.strip() not in ("", "..."):
                    block[-1][1].append(x)
            commands += block
            continue
        commands += [(strip_comment(x), []) for x in lines if strip_comment(x)]
    return commands


def readme_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, lines shown) of every page of `DOCS`, in the walk's order."""
    return [(page(path), *c) for path in DOCS for c in page_commands(path)]


def python_snippets() -> list[tuple[str, str]]:
    """(page, code) of every Python block of `DOCS`."""
    return [
        (page(path), "\n".join(lines))
        for path in DOCS
        for lang, lines in code_blocks(path.read_text())
        if lang == "python"
    ]


def table_commands() -> list[str]:
    """Every command of the command table (docs/cli.md; any page of `DOCS` may hold rows), its forms expanded: a
    span that starts with `--` continues the command before it, optional `[...]` parts are given (except
    `[--set ...]`), and each alternative `A|B` is a command of its own."""
    commands = []
    for line in (x for path in DOCS for x in path.read_text().splitlines()):
        if not line.startswith("| `usaf "):
            continue
        head = None
        for span in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if span.startswith("--") and head:
                span = f"{head} {span}"
            head = span.split(" --")[0]
            span = re.sub(r"\[--set [^\]]*\]", "", span).replace("[", "").replace("]", "")
            forms = [[]]
            for word in span.replace("\\|", "|").split():
                forms = [[*f, alt] for f in forms for alt in word.split("|")]
            commands += [" ".join(f) for f in forms]
    return commands


def test_docs_lists_every_page():
    """A page added to docs/ is walked: `DOCS` names every one, each once, the README first."""
    assert DOCS[0] == README and len(set(DOCS)) == len(DOCS) and all(p.is_file() for p in DOCS)
    assert set((ROOT / "docs").glob("*.md")) <= set(DOCS)


def test_readme_has_the_journey_this_test_walks():
    """The parsing above finds the walk-through and the docs' commands (pages that lost them would pass the
    journey vacuously)."""
    commands = readme_commands()
    readme = [shlex.split(c)[:2] for p, c, _ in commands if p == "README.md"]
    # the newcomer's two commands, first, and no other make target
    assert readme[:2] == [w for w in readme if w[0] == "make"] == [["make", "demo"], ["make", "test"]], readme
    assert ["usaf", "train"] in readme and ["usaf", "generate"] in readme and ["usaf", "export"] in readme
    in_docs = [(p, shlex.split(c)[:2], shown) for p, c, shown in commands if p.startswith("docs/")]
    assert {"docs/memory.md", "docs/distributed.md", "docs/python.md"} <= {p for p, _, _ in in_docs}
    transcripts = [p for p, w, shown in in_docs if w == ["usaf", "plan"] and shown]
    assert transcripts.count("docs/memory.md") >= 1 and transcripts.count("docs/distributed.md") >= 6
    snippets = [p for p, _ in python_snippets()]
    assert "README.md" in snippets and "docs/python.md" in snippets
    table = [shlex.split(c)[1] for c in table_commands()]
    assert {"train", "eval", "data", "select", "plan", "prepare", "export", "apply", "report"} <= set(table)
    unknown = {(p, shlex.split(c)[0]) for p, c, _ in commands}
    unknown = {(p, w) for p, w in unknown if w != "usaf" and w not in OTHER_TOOLS}
    assert not unknown, f"documented commands this test does not know how to check: {unknown}"


def users_folder(tmp_path: Path) -> Path:
    """What the pages presume: the user's data, prompts, and the repository's example configs."""
    home = tmp_path / "user"
    home.mkdir()
    train = (BUNDLED / "data" / "train.jsonl").read_text().splitlines()
    (home / "my.jsonl").write_text("\n".join(train[:64]) + "\n")
    prompts = [
        json.loads(x)["prompt"] for x in (BUNDLED / "data" / "eval.jsonl").read_text().splitlines()[:3]
    ]
    (home / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (home / "examples").symlink_to(ROOT / "examples")
    return home


def as_the_journey_runs(argv: list[str]) -> list[str]:
    """A documented command as run here: the bundled model for the user's (train's hub id or --config names a 30B
    model), few steps."""
    if argv[0] == "train":
        if "--model" in argv:  # the hub's Qwen3-30B-A3B: nothing is downloaded here
            at = argv.index("--model")
            argv = [*argv[:at], *argv[at + 2 :]]
        argv = [*argv, f"--model={BUNDLED / 'model'}", "--set", *FAST]
    return argv


@pytest.mark.slow
def test_the_readme_walk_through_runs_on_the_bundled_model(tmp_path, monkeypatch, capsys):
    home = users_folder(tmp_path)
    monkeypatch.chdir(home)
    monkeypatch.setenv("LLAMA_CPP", str(fake_llama_cpp(tmp_path / "llama.cpp")))
    walked, expected = [], [(p, shlex.split(c)[1]) for p, c, _ in readme_commands() if c.startswith("usaf ")]
    for path, command, shown in readme_commands():
        argv = shlex.split(command)
        if argv[0] != "usaf":
            continue
        if argv[1] == "chat":
            monkeypatch.setattr(sys, "stdin", io.StringIO("shift: abc -> \n/reset\nhi\n/exit\n"))
        code = main(as_the_journey_runs(argv[1:]))
        out, err = capsys.readouterr()
        assert code == 0, f"{path}: command `{command}` exited {code}: {err.strip()[-500:]}"
        assert "Traceback" not in out + err
        printed = {" ".join(x.split()) for x in out.splitlines()}
        missing = [x for x in shown if " ".join(x.split()) not in printed]
        assert not missing, f"{path}: `{command}` no longer prints what the page shows: {missing}"
        walked.append((path, argv[1]))
    assert walked == expected  # every usaf command of every page, none skipped
    assert {"plan", "train", "generate", "chat", "export"} <= {w for p, w in walked if p == "README.md"}
    assert {p for p, _ in walked} >= {"docs/memory.md", "docs/distributed.md"}
    # what the walk-through promises it left behind
    run = home / "runs" / "a"
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    rows = [json.loads(x) for x in (home / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all("base" in json.dumps(r) for r in rows)  # --compare-base: the base's too
    merged = home / "out" / "merged"
    assert set(load_file(str(merged / "model.safetensors"))) == set(
        load_file(str(BUNDLED / "model" / "model.safetensors"))
    )
    assert (home / "out" / "model.gguf").read_bytes().startswith(b"GGUF")


@pytest.mark.slow
@pytest.mark.parametrize(
    "index", range(len(python_snippets())), ids=[f"{p}-{i}" for i, (p, _) in enumerate(python_snippets())]
)
def test_each_readme_python_snippet_runs_as_written(index, tmp_path):
    code = python_snippets()[index][1].replace(MODEL_PLACEHOLDER, str(BUNDLED / "model"))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_make_demo_runs_usaf_demo():
    """`make demo` is `usaf demo` after the set-up (test_demo_task.py checks what the demo teaches)."""
    makefile = (ROOT / "Makefile").read_text()
    target = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "usaf demo" in target


def table_values(home: Path):
    """What each placeholder of the command table stands for in the user's folder: inputs are the bundled model and
    data and what earlier commands made; every output placeholder is a new name at each use."""
    made = iter(range(1000))
    fixed = {
        "DIR": str(BUNDLED / "model"), "MODEL_DIR": str(BUNDLED / "model"), "BASE": str(BUNDLED / "model"),
        "config.json": str(BUNDLED / "model" / "config.json"), "PRESET": "qwen3-30b-a3b",
        "FILE,FILE": "my.jsonl,more.jsonl", "RUN": "runs/t", "MODEL_OR_RUN": "runs/t", "run.yaml": "run.yaml",
        "OUT.safetensors": "delta.safetensors", "DELTA": "delta.safetensors", "N": "2",
    }  # fmt: skip
    outputs = {"OUT_DIR", "OUT.jsonl", "OUT.gguf", "PREPARED", "sel.safetensors"}

    def value(word: str, option: str | None) -> str:
        if word == "FILE":
            return "prompts.jsonl" if option == "--prompts" else "my.jsonl"
        if word in outputs:
            stem, dot, ext = word.partition(".")
            return f"{stem.lower()}-{next(made)}{dot}{ext}"
        return fixed.get(word, word)

    (home / "more.jsonl").write_text((home / "my.jsonl").read_text())
    (home / "run.yaml").write_text("schedule:\n  max_steps: 2\n  grad_accum: 1\nlog:\n  progress: false\n")
    return value


@pytest.mark.slow
def test_every_command_of_the_readme_table_runs(tmp_path, monkeypatch, capsys):
    """The command table's forms (docs/cli.md), in its order, on the bundled model (inputs first made by the commands above
    them: the run by `usaf train`, the delta by `usaf export --delta`)."""
    home = users_folder(tmp_path)
    monkeypatch.chdir(home)
    monkeypatch.setenv("LLAMA_CPP", str(fake_llama_cpp(tmp_path / "llama.cpp", quantize=True)))
    monkeypatch.setattr(sys, "stdin", io.StringIO("shift: abc -> \n/exit\n"))
    value = table_values(home)
    for command in table_commands():
        words, argv = shlex.split(command)[1:], []
        for i, word in enumerate(words):
            argv.append(value(word, words[i - 1] if i else None))
        if argv[0] == "train" and "--resume" not in argv and "--out" in argv:
            argv += ["--set", *FAST]
        if argv[0] == "demo":  # its 500 steps are test_demo_task.py's; here, that it runs
            argv += ["--out=demo", "--set=schedule.max_steps=3"]
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 0, f"table command `{command}` (run as {argv}) exited {code}: {err.strip()[-500:]}"
        assert "Traceback" not in out + err
    assert (home / "delta.safetensors").is_file() and (home / "runs" / "t" / "summary.json").is_file()
