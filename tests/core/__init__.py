"""The core on its own: layering, optional imports, environment variables and logging."""
