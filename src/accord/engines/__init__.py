"""One folder per communication engine: its collective, its strategies, its own parts.

An engine folder imports `accord.core` and the engine-neutral packages, never another engine.
"""
