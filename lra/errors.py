"""The one error type the command line turns into a one-line message and exit status 2."""


class UserError(Exception):
    """Bad input from the user: the message says what was wrong and what is valid."""
