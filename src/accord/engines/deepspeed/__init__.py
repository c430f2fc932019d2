"""DeepSpeed: its collective, and the ZeRO strategy with its config, checkpoints and ZeRO-3."""
