"""A GGUF file and where it runs: opening it (memory-mapped) and its metadata as a config, the embedded
default model, the file's identity, each tensor's placement on devices, the compute path and the backend
chosen once per device."""

from .backend import Backend
from .compute_path import DTYPE_NAMES, EXACT, ComputePath, resolve
from .default_model import default_model_path
from .fingerprint import model_file_identity
from .gguf_file import GGUFFile, ModelConfig, bits_per_weight, check_gguf_path, describe_types
from .placement import EMBEDDING, Placement, SplitError, check_device, check_split, parse_devices, parse_layer_split

__all__ = [
    "Backend",
    "ComputePath",
    "DTYPE_NAMES",
    "EMBEDDING",
    "EXACT",
    "GGUFFile",
    "ModelConfig",
    "Placement",
    "SplitError",
    "bits_per_weight",
    "check_device",
    "check_split",
    "check_gguf_path",
    "default_model_path",
    "describe_types",
    "model_file_identity",
    "parse_devices",
    "parse_layer_split",
    "resolve",
]
