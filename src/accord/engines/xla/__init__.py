"""XLA (TPU, and torch_xla's CPU runtime): collective, strategies, launcher, device, environment."""
