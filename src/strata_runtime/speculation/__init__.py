"""Speculative decoding: drafters (the sequence's own earlier tokens, or a draft model) and the verify
that runs inside the scheduler's step."""

from .draft_model import DraftModelDrafter
from .drafting import SuffixDrafter
from .verify import Speculation, check_settings, drafter_for, spare_states

__all__ = [
    "DraftModelDrafter",
    "Speculation",
    "SuffixDrafter",
    "check_settings",
    "drafter_for",
    "spare_states",
]
