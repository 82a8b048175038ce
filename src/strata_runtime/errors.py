"""Errors a person can act on: each names what went wrong and the fix."""


class StrataError(Exception):
    """Base of the errors Strata raises on purpose (bad input, bad files)."""


class ModelFileError(StrataError):
    """A model file that cannot be used, with the file named and the fix stated."""
