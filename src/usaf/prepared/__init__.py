"""Prepared stores: a checkpoint quantized to disk, and a model loaded from one for training."""
