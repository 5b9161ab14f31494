"""What the model is: its MoE layers and every layout fact, the tensors usaf can train, transformers' internals."""
