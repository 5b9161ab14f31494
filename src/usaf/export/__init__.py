"""What a run produces: delta files, merged checkpoints, a delta loaded into a live model."""
