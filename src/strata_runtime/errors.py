"""Errors a person can act on: each names what went wrong and the fix."""


class StrataError(Exception):
    """Base of the errors Strata raises on purpose (bad input, bad files)."""


class RequestError(StrataError, ValueError):
    """A request's arguments are wrong (the caller's to fix; a server answers 400).

    Raised only by argument checks, before the request touches any state.
    Also a ``ValueError``, as argument errors are in Python."""


class RequestTypeError(RequestError, TypeError):
    """A request argument of the wrong type or name (also a ``TypeError``)."""


class ModelFileError(StrataError):
    """A model file that cannot be used, with the file named and the fix stated."""


class ContextLengthError(RequestError):
    """A prompt that does not fit the context (never truncated silently).

    Raised with the prompt's token count, or, for text too long to be worth
    tokenizing, with its character count and the most characters the
    context's tokens can spell."""

    def __init__(self, prompt_tokens: int | None, context_length: int, *, characters: int | None = None,
                 max_characters: int | None = None):
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        self.characters = characters
        if prompt_tokens is not None:
            what = f"the prompt has {prompt_tokens} tokens but the context holds {context_length}"
        else:
            what = (f"the prompt has {characters} characters, more than the {context_length} tokens of the "
                    f"context can hold (at most {max_characters} characters)")
        super().__init__(f"{what}; shorten the prompt or load with a larger context_length")


class Cancelled(StrataError):
    """The caller asked to stop (its ``abort`` said yes) before the work was done."""


class QueueFull(StrataError):
    """The engine's waiting queue is at its bound; retry shortly."""
