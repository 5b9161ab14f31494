"""Run one benchmark function in a fresh fork of a server process, so that the parent never imports torch (seconds
saved per run) and keeps no model memory: `call_in_fork(context, "compare", "environment", device="cpu")`."""

from __future__ import annotations

import importlib
import traceback


def call_main(conn, module: str, name: str, kwargs: dict) -> None:
    """Entry point of a helper process: run `module.name(**kwargs)`, send back its result or its traceback."""
    try:
        conn.send({"result": getattr(importlib.import_module(module), name)(**kwargs)})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def call_in_fork(context, module: str, name: str, **kwargs):
    """`module.name(**kwargs)` in a fresh process of `context` (a multiprocessing context); its result."""
    parent, child = context.Pipe()
    proc = context.Process(target=call_main, args=(child, module, name, kwargs), daemon=True)
    proc.start()
    child.close()
    try:
        reply = parent.recv()
    except EOFError:
        reply = {"error": f"{name}: the helper process died (exit code {proc.exitcode})"}
    proc.join()
    if "error" in reply:
        raise RuntimeError(reply["error"])
    return reply["result"]
