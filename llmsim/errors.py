"""The one error type users see: a bad setting, explained in a paragraph."""
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
            text += f" (got {self.value!r})"
        if self.allowed:
            text += f". Allowed: {self.allowed}"
        return text + "."
