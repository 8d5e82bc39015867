"""User-facing errors: the CLI prints these as one line, without a traceback."""

import errno



class TokenUnlearnError(Exception):
    """A problem with the user's input (a file, a row, a parameter) that the user can fix."""


class DataError(TokenUnlearnError):
    """A data file is missing, malformed, or has a bad row."""


class ParamError(TokenUnlearnError):
    """A parameter is unknown, missing, or out of range."""


SYSTEM_ERRNOS = {  # errors of the machine, not of the code: one line each, as the user's errors
    errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded", errno.EACCES: "permission denied",
    errno.EROFS: "read-only file system"}


def system_error(e: Exception) -> str | None:
    """The machine's fault (a full disk, a permission) as one line, or None. Libraries that write in Rust or C++
    (safetensors, pyarrow) report a full disk in their own exception's text, not as an OSError."""
    if isinstance(e, OSError) and e.errno in SYSTEM_ERRNOS:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{SYSTEM_ERRNOS[e.errno]} ({e.strerror})"
    text = str(e)
    if "No space left on device" in text or "StorageFull" in text or "code: 28," in text:
        return f"{SYSTEM_ERRNOS[errno.ENOSPC]} ({type(e).__name__}: {text.splitlines()[0][:200]})"
    return None
