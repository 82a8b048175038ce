"""The model interface (``decoder``), the shared layers (linears over ``QuantTensor``, norms, rotary, gated
MLPs, a routed MoE, the gated delta rule), one file per architecture, the loader that builds a model from
a GGUF file, and running one sequence over its cache (``generation``)."""

from .decoder import finish
from .fused_decode import FusedDecode
from .generation import decode_logits_of, decode_step, forward_chunks, prefill
from .layers import weight_paths
from .loader import build_model, check_vocabulary, open_model

__all__ = [
    "FusedDecode",
    "build_model",
    "check_vocabulary",
    "decode_logits_of",
    "decode_step",
    "finish",
    "forward_chunks",
    "open_model",
    "prefill",
    "weight_paths",
]
