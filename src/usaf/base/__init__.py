"""The frozen base on disk: a checkpoint quantized into a prepared store, loaded for training, read back in its own layout for export, recorded by a run."""
