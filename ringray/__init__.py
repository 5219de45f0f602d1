"""ringray: exact ring attention and elastic long-context training on Ray."""

__version__ = "0.1.0"
