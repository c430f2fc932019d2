"""The Trainer: loops, hooks, logging, checkpoint triggers and Lightning parity."""
