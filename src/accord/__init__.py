"""accord: a PyTorch trainer whose training strategies each own a composed collective."""

__version__ = "0.1.0"

__all__ = ["__version__"]
