"""What ends a command early: a bad setting explained in a paragraph (exit 2), or a stop that kept
its finished work (Ctrl-C, a full disk)."""
from __future__ import annotations


class ConfigError(Exception):
    """A setting that cannot be used, with where it came from and what is allowed.

    The CLI prints ``str(error)`` and exits with status 2; nothing else about
    bad input should reach the user as a traceback.
    """

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None,
                 value: object = None, allowed: str | None = None, has_value: bool = True):
        self.file, self.key, self.value, self.allowed = file, key, value, allowed
        self.message = message
        self.has_value = has_value
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = []
        if self.file:
            where.append(f"in {self.file}")
        if self.key:
            where.append(f"at key '{self.key}'")
        text = "Configuration error"
        if where:
            text += " " + ", ".join(where)
        text += f": {self.message}"
        if self.key and self.has_value:
            text += f" (got {shown(self.value)})"
        if self.allowed:
            text += f". Allowed: {self.allowed}"
        return " ".join(text.split()) + "."       # one paragraph, whatever a quoted library message held


LONGEST_VALUE = 160         # characters of a value quoted in an error; a 400-digit number or a big mapping is cut


def shown(value: object) -> str:
    """``repr(value)``, its middle cut out when it is longer than :data:`LONGEST_VALUE` characters."""
    text = repr(value)
    if len(text) <= LONGEST_VALUE:
        return text
    half = LONGEST_VALUE // 2
    return f"{text[:half]}...({len(text) - LONGEST_VALUE:,} characters)...{text[-half:]}"


class Stopped(Exception):
    """A command stopped before its end, what it kept said in the message; ``status``: its exit status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
