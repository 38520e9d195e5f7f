"""The error types kvgen raises on bad input: each message says what was wrong and where."""


class KVGenError(Exception):
    """Base of every error kvgen reports to a user (the CLI prints it without a traceback)."""


class ModelLoadError(KVGenError):
    """A model file is unknown, truncated or inconsistent. The message names the file and the problem."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class InvalidRequestError(KVGenError, ValueError):
    """A request that can never be served: a bad sampling parameter, a prompt too long, and so on."""
