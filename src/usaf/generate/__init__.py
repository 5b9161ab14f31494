"""Trying a fine-tune: open what was trained (a run, a merged export, a base with a delta, a prepared store),
read prompts, and generate from the tuned model and, beside it, from its base (`usaf generate`, `usaf chat`)."""
