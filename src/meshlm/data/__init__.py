"""Data: built-in corpus, loading, tokenising into blocks, distributed sampling."""
