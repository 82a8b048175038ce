"""A layer split applied from outside a model: stages on several devices of one process (``Pipeline``),
or one stage per ``torch.distributed`` rank (``ranks``: wire, driver, follower), on plans made from the
metadata alone."""

from .pipeline import Pipeline, plan_split
from .ranks import RankPipeline, follow, join_stage, launched_with_ranks, ready, this_rank

__all__ = [
    "Pipeline",
    "RankPipeline",
    "follow",
    "join_stage",
    "launched_with_ranks",
    "plan_split",
    "ready",
    "this_rank",
]
