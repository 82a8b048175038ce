"""Sequences in flight: the scheduler (admission, batches of decode rows and prefill chunks, preemption,
residents parked to the conversation cache), sampling, and a ``Run``: one generation turned into text."""

from .batch import Batch
from .constraint import Constraint
from .reserve import reserve_scheduler
from .run import Completion, Run, run_together
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler
from .sequence import Generation

__all__ = [
    "Batch",
    "Completion",
    "Constraint",
    "Generation",
    "Run",
    "Sampler",
    "SamplingParams",
    "Scheduler",
    "reserve_scheduler",
    "run_together",
]
