"""The one exception type that means "the user asked for something wrong".

It is shown as a single `meshlm: error: ...` line with exit status 2; anything
else is a bug or a failure and keeps its traceback.
"""

EXIT_USAGE = 2


class MeshlmError(Exception):
    """Bad input: shown as one line, exit status 2."""
