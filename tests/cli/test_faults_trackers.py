"""Issue 35, trackers never hang or kill a run: a tracker that cannot start (an MLflow server that refuses or never
answers, W&B without an API key or without a server, a database store without its packages, a tracker whose
start fails or hangs) is one line naming the variable to set, before anything is written, within seconds. The
servers are local sockets on 127.0.0.1; nothing else is reached. What a tracker does once started (an error
mid-run, its close, the final evaluation) is in tests/train/test_final_eval.py."""

from __future__ import annotations

import functools
import socket
import sys
import threading
import time

from faults import NEW, Row, T, table_test

from usaf.cli import main
from usaf.train import trackers
from usaf.train.trackers import Tracker


@functools.cache
def silent_port() -> int:
    """A port on 127.0.0.1 that accepts connections and never answers (for the test session)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def accept():
        while True:
            held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    return server.getsockname()[1]


def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlflow_at(uri: str):
    def setup(ctx, monkeypatch):
        monkeypatch.setattr(
            trackers, "PROBE_TIMEOUT_S", 1.0
        )  # the table's rows stay fast; the default: below
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri.format(tmp=ctx.tmp))

    return setup


def mlflow_never_answers(ctx, monkeypatch):
    mlflow_at(f"http://127.0.0.1:{silent_port()}")(ctx, monkeypatch)


def mlflow_refused(ctx, monkeypatch):
    mlflow_at(f"http://127.0.0.1:{closed_port()}")(ctx, monkeypatch)


def sqlite_without_sqlalchemy(ctx, monkeypatch):
    mlflow_at("sqlite:///{tmp}/mlflow.db")(ctx, monkeypatch)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # as if not installed


def wandb_without_key(ctx, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(ctx.tmp))  # no ~/.netrc with a saved key


def wandb_server_refused(ctx, monkeypatch):
    wandb_without_key(ctx, monkeypatch)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef" * 2 + "01234567")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")


def tracker_whose_start(does):
    """log.report_to=fake, a tracker whose start does `does()`."""

    class Fake(Tracker):
        name, package, install = "fake", "json", "nothing"

        def start(self, run_dir, config, start_step):
            does()

    def setup(ctx, monkeypatch):
        monkeypatch.setitem(trackers.TRACKERS, Fake.name, Fake)
        monkeypatch.setattr(trackers, "START_TIMEOUT_S", 1.0)

    return setup


def fails():
    raise RuntimeError("the notebook service is down")


def hangs():
    time.sleep(20)  # a daemon thread: left behind, it ends by itself


MLFLOW, WANDB, FAKE = "--set=log.report_to=mlflow", "--set=log.report_to=wandb", "--set=log.report_to=fake"
NOTHING_WRITTEN = ["{tmp}/run"]
HINT_MLFLOW = "unset it to keep the store in the run folder, or leave mlflow out of log.report_to"
HINT_WANDB = ["`wandb login`", "set WANDB_API_KEY", "WANDB_MODE=offline", "leave wandb out of log.report_to"]

# fmt: off
ROWS = [
    Row("mlflow-server-never-answers", T(*NEW, MLFLOW), 2,
        ["log.report_to=mlflow, but MLFLOW_TRACKING_URI=http://127.0.0.1:", "(no answer in 1 s)", HINT_MLFLOW],
        setup=mlflow_never_answers, absent=NOTHING_WRITTEN),
    Row("mlflow-server-refuses", T(*NEW, MLFLOW), 2,
        ["MLFLOW_TRACKING_URI=http://127.0.0.1:", "does not answer", "refused", HINT_MLFLOW],
        setup=mlflow_refused, absent=NOTHING_WRITTEN),
    Row("mlflow-sqlite-without-sqlalchemy", T(*NEW, MLFLOW), 2,
        ["MLFLOW_TRACKING_URI=sqlite:///{tmp}/mlflow.db is a database store, which needs SQLAlchemy and Alembic",
         "pip install 'usaf[mlflow]'"],
        setup=sqlite_without_sqlalchemy, absent=[*NOTHING_WRITTEN, "{tmp}/mlflow.db"]),
    Row("wandb-without-api-key", T(*NEW, WANDB), 2, ["W&B has no API key", *HINT_WANDB],
        setup=wandb_without_key, absent=NOTHING_WRITTEN),
    Row("wandb-server-refuses", T(*NEW, WANDB), 2,
        ["log.report_to=wandb, but WANDB_BASE_URL=http://127.0.0.1:", "refused", *HINT_WANDB],
        setup=wandb_server_refused, absent=NOTHING_WRITTEN),
    Row("tracker-start-fails", T(*NEW, FAKE), 2,
        ["log.report_to=fake did not start (RuntimeError: the notebook service is down)",
         "leave fake out of log.report_to"],
        setup=tracker_whose_start(fails), absent=NOTHING_WRITTEN),
    Row("tracker-start-hangs", T(*NEW, FAKE), 2,
        ["log.report_to=fake did not start (TimeoutError: no answer in 1 s)"],
        setup=tracker_whose_start(hangs), absent=NOTHING_WRITTEN),
    Row("tracker-not-installed", T(*NEW, MLFLOW), 2,
        ["log.report_to=mlflow, but no_such_module is not installed: pip install 'usaf[mlflow]'"],
        setup=lambda ctx, mp: mp.setattr(trackers.MLflow, "package", "no_such_module"),
        absent=NOTHING_WRITTEN),
]
# fmt: on

test_fault = table_test(ROWS)


def test_an_mlflow_server_that_never_answers_fails_in_seconds(ws, tmp_path, monkeypatch, capsys):
    """At the default probe time: the issue's run hung for minutes (still hanging after 200 s)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{silent_port()}")
    started = time.monotonic()
    rc = main(T(f"--model={ws.base}", f"--data={ws.data}", f"--out={tmp_path / 'run'}", MLFLOW))
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"(no answer in {trackers.PROBE_TIMEOUT_S:g} s)" in err, err
    assert took < trackers.PROBE_TIMEOUT_S + 5, took
