"""Bytes on disk: atomic writes, safetensors shards, a checkpoint read through transformers' renamings, the base record."""
