"""Errors a person can act on: each names what went wrong and the fix."""


class StrataError(Exception):
    """Base of the errors Strata raises on purpose (bad input, bad files)."""


class ModelFileError(StrataError):
    """A model file that cannot be used, with the file named and the fix stated."""


class ContextLengthError(StrataError):
    """A prompt that does not fit the context (never truncated silently)."""

    def __init__(self, prompt_tokens: int, context_length: int):
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        super().__init__(
            f"the prompt has {prompt_tokens} tokens but the context holds {context_length}; "
            f"shorten the prompt or load with a larger context_length"
        )


class Cancelled(StrataError):
    """The caller asked to stop (its ``abort`` said yes) before the work was done."""
