"""The memory planner: a run's ledger, verdict and step-time estimate from a model's config alone."""
