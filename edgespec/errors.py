"""Errors the CLI turns into one line on stderr and exit code 2."""


def one_line(text: str) -> str:
    """A message on one line (names and library errors may carry newlines)."""
    return " ".join(str(text).split())


class EdgespecError(Exception):
    """Bad input or a usage problem: the message says what is wrong and what to do."""

    exit_code = 2
