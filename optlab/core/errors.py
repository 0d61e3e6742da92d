"""The one exception type optlab raises for bad input: its message is meant for people."""


class OptlabError(ValueError):
    """Bad input or an impossible request. The message says what was given and what is allowed."""


def choice_error(what: str, given: object, allowed: "list[str] | tuple[str, ...]") -> OptlabError:
    """An error for a value that is not one of a fixed set of names."""
    return OptlabError(f"unknown {what} {given!r}; choose one of: {', '.join(map(str, allowed))}")
