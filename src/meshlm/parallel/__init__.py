"""One file per parallel technique; apply.py composes them in a fixed order."""
