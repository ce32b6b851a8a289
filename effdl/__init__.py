"""effdl: efficient deep-learning training components, measured on a real GPU."""

__version__ = "0.1.0"
