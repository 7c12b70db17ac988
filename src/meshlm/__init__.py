"""meshlm: train and run large language models across many GPUs and nodes."""

__version__ = "0.1.0"
