"""The documentation: its python examples run, and its reference covers every public name."""
