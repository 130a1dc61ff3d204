"""Errors the application raises for user mistakes; the CLI prints them as one line."""


class SeqkvError(Exception):
    """A problem the user can fix; str(error) is the one line shown, exit_code the status."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
