"""What to train: the budget, calibration, the choice of entries, reselection during a run."""
