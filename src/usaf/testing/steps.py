"""One optimizer step as usaf's loop takes it (observe, forward, backward, step, reselect), for tests and
benchmarks that drive the engine without the whole Trainer."""

from __future__ import annotations

from usaf.engine.loss import causal_lm_loss


def training_step(model, optimizer, ids, labels=None, reselector=None, step: int = 0, reselect: bool = True):
    """One step on `ids` (labels: `ids` when None); the reselection's report, or None (no reselector, none due,
    or `reselect=False`: the step up to, not including, the reselection that may follow it)."""
    if reselector is not None:
        reselector.before_step(step)
        reselector.set_observing(True)
    loss = causal_lm_loss(model, ids, ids if labels is None else labels)
    if reselector is not None:
        reselector.set_observing(False)  # recomputation in backward re-runs forwards: count them once
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss
    return reselector.after_step(step, optimizer) if reselector is not None and reselect else None
