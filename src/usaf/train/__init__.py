"""The training job: run folder, data, the loop, checkpoints, evaluation, runtime."""
