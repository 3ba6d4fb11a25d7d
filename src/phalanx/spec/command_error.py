"""The one error every `phalanx` sub-command raises for a mistake in its input (a leaf module:
the sub-commands import it without importing the command line that loads them)."""

__all__ = ["CommandError"]


class CommandError(Exception):
    """A user error in a command's input: printed as one line, exit status 2."""
