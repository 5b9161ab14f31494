"""`usaf train --set train.objective=orpo|simpo|kto` on the bundled preference pairs and on KTO's unpaired
records: a few steps, TRL's metric names in metrics.jsonl, one-line errors for data of the wrong shape, and what
`usaf plan` counts of each."""

import json
import re
from pathlib import Path

import pytest
from helpers import FAST_RUN, make_model_dir, plans_by_objective

import usaf
from usaf.cli import main
from usaf.data import Batches, load_dataset
from usaf.data.pairs import LabelledRows
from usaf.train.tokenizer import char_tokenizer

BUNDLED_PAIRS = Path(usaf.__file__).parent / "demo_assets" / "data" / "preference_train.jsonl"
METRICS = {
    "orpo": {"nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/margins", "rewards/accuracies"},
    "simpo": {"nll_loss", "rewards/margins", "rewards/accuracies", "logps/chosen"},
    "kto": {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/rejected"},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("objectives") / "model")


def train(model, data, out, *sets) -> int:
    options = [*FAST_RUN, "schedule.max_steps=2", "data.eval_fraction=0.02", *sets]
    return main(
        ["train", f"--model={model}", f"--data={data}", f"--out={out}", *[f"--set={s}" for s in options]]
    )


def metric_rows(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


@pytest.mark.slow  # a whole run each (selection, evaluation, checkpoint): 5-40 s on a busy 2-core CPU
@pytest.mark.parametrize("objective", ["orpo", "simpo", "kto"])
def test_each_objective_trains_on_the_bundled_pairs(model, tmp_path, objective):
    assert train(model, BUNDLED_PAIRS, tmp_path / "run", f"train.objective={objective}") == 0
    rows = metric_rows(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2]
    assert all(METRICS[objective] <= set(row) for row in rows)
    # held out by the objective's own loss and metrics (what best_metric and early stopping rank), not DPO's
    every = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [row for row in every if "eval/loss" in row]
    assert evaluations and all(
        {f"eval/{name}" for name in METRICS[objective]} <= set(row) for row in evaluations
    )


@pytest.mark.slow
def test_kto_trains_on_unpaired_records(model, tmp_path):
    data = tmp_path / "unpaired.jsonl"
    words = ["abcde", "fedcb", "bead", "faced", "cabbed", "dabbe"] * 4
    data.write_text(
        "".join(
            json.dumps(
                {"prompt": f"copy {w} ->", "completion": f" {w if i % 3 else w[::-1]}", "label": bool(i % 3)}
            )
            + "\n"
            for i, w in enumerate(words)
        )
    )
    assert train(model, data, tmp_path / "run", "train.objective=kto") == 0
    rows = metric_rows(tmp_path / "run")
    assert len(rows) == 2 and all(row["tokens"] > 0 and "kl" in row for row in rows)


@pytest.mark.parametrize(
    "objective, record, says",
    [
        ("kto", {"prompt": "a", "completion": "b"}, "this record has no 'label'"),
        ("kto", {"prompt": "a", "completion": "b", "label": "yes"}, "'label' must be true"),
        ("kto", {"messages": [{"role": "user", "content": "x"}], "label": True}, "not messages records"),
        (
            "orpo",
            {"prompt": "a", "completion": "b"},
            "orpo trains on preference pairs (prompt/chosen/rejected)",
        ),
        ("simpo", {"text": "a"}, "simpo trains on preference pairs"),
    ],
)
def test_data_of_the_wrong_shape_is_one_line(model, tmp_path, capsys, objective, record, says):
    data = tmp_path / "bad.jsonl"
    data.write_text(
        json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}) + "\n" + json.dumps(record) + "\n"
    )
    assert train(model, data, tmp_path / "run", f"train.objective={objective}") == 2
    err = capsys.readouterr().err
    assert f"{data}:2: " in err and says in err and len(err.strip().splitlines()) == 1


def test_kto_needs_two_rows_a_micro_batch(model, tmp_path, capsys):
    """KTO's KL term pairs each prompt with another row's answer: with one row a micro-batch, its own."""
    assert train(model, BUNDLED_PAIRS, tmp_path / "run", "train.objective=kto", "data.batch_size=1") == 2
    err = capsys.readouterr().err
    assert "kto needs data.batch_size of 2 or more" in err and len(err.strip().splitlines()) == 1


def test_the_planner_counts_each_objectives_rows_and_passes(tmp_path, capsys):
    shown, batch = plans_by_objective(["sft", "orpo", "kto"], tmp_path, capsys)
    assert f"x batch {2 * batch}," in shown["orpo"] and f"x batch {batch}," in shown["kto"]
    assert (
        "fourth pass" not in shown["orpo"]
        and "3 forwards without gradients are passes 4 to 6" in shown["kto"]
    )
    step = {k: float(re.search(r"step ~ ([\d.]+) s", v).group(1)) for k, v in shown.items()}
    assert step["kto"] > 1.5 * step["sft"]  # six passes, not three


def test_kto_reads_pairs_unpaired_and_labelled_records_as_labelled_rows(tmp_path):
    data = tmp_path / "mixed.jsonl"
    records = [
        {"prompt": "copy ab ->", "chosen": " ab", "rejected": " ba"},
        {"prompt": "copy cd ->", "completion": " dc", "label": False},
        {"prompt": "copy ef ->", "completion": " ef", "label": True},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = char_tokenizer()
    rows, _, _ = load_dataset([str(data)], tokenizer, 32, eval_fraction=0.0, objective="kto")
    assert isinstance(rows, LabelledRows) and len(rows) == 4
    batch = next(iter(Batches(rows, 4, shuffle=False)))
    answers = [
        tokenizer.decode(ids[labels != -100][:-1])
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True)
    ]
    assert answers == [" ab", " ba", " dc", " ef"]
    assert batch["label"].tolist() == [True, False, False, True]
