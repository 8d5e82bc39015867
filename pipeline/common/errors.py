"""User-facing errors: the CLI prints these as one line, without a traceback."""


class TokenUnlearnError(Exception):
    """A problem with the user's input (a file, a row, a parameter) that the user can fix."""


class DataError(TokenUnlearnError):
    """A data file is missing, malformed, or has a bad row."""


class ParamError(TokenUnlearnError):
    """A parameter is unknown, missing, or out of range."""
