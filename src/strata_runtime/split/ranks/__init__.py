"""Layer-split stages across processes: one stage per ``torch.distributed`` rank.

Launched by ``torchrun`` (or anything that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``). Rank 0 runs the engine: it tokenizes,
samples, keeps the conversation cache and serves; its model is the first
stage. Every other rank runs ``follow()``: it loads only the weights of its
own layers (the others stay shapes on the meta device) and runs them when
rank 0 says so. Every rank plans the same split from the GGUF metadata, so a
bad split fails on every rank before any weight is read.

The wire: gloo over TCP, and NCCL for the hidden states and logits when
every stage has a GPU of its own (``open_wire``). Rank 0 drives. Each command travels the chain
0 -> 1 -> ... -> last, every follower acting on it and passing it on, so a
follower only ever listens to its predecessor. Replies go straight to rank 0,
which waits for each before it sends the next command, so messages never
interleave. Commands are small JSON objects:

- ``new_cache`` / ``free_cache``: a follower keeps a twin, over its own
  layers, of every cache rank 0 makes.
- ``forward``: the hidden state ``[T, hidden]`` follows the command; each
  follower runs its layers and passes the state on; the last applies the
  final norm and the output head and sends the logits to rank 0.
- ``read_parts`` / ``write_parts``: one stage's part of a snapshot or
  checkpoint, moved between that rank's cache and rank 0's staging pool. The
  bytes are received into (or sent from) the pool's pages and the cache's
  rows directly: parking allocates no host memory (ARCHITECTURE's memory
  rule), so the parked parts of every stage live in rank 0's pool.
- ``stop``: the job is over.

Failure. A follower that fails a command (an error in its layers, a bad
part) reports it to rank 0 and stays up. A rank that dies closes its
connections; one that hangs stops answering: either way rank 0's next wait
fails at once or after ``rank_timeout_s`` and raises ``StageLost``, which
names the rank. A follower whose predecessor is gone stops with an error.
"""

from .common import StageLost
from .driver import RankPipeline
from .follower import Follower, follow
from .setup import join_stage, launched_with_ranks, plan_ranks, ready, this_rank

__all__ = ["Follower", "RankPipeline", "StageLost", "follow", "join_stage", "launched_with_ranks", "plan_ranks",
           "ready", "this_rank"]
