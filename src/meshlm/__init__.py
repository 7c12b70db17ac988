"""meshlm: train and run large language models across many GPUs and nodes."""

from meshlm import quiet

__version__ = "0.1.0"

quiet.install()  # before anything imports transformers (and with it torchao): see quiet.py
