"""Errors the CLI turns into one line on stderr and exit code 2."""


class EdgespecError(Exception):
    """Bad input or a usage problem: the message says what is wrong and what to do."""

    exit_code = 2
