"""Packed-directory container: 64-byte-aligned safetensors shards (docs/PACKED_FORMAT.md).

    from moepack.container import ShardPlan, ShardWriter, atomic_directory, open_shard

    with atomic_directory("out/model-moepack") as tmp:
        plan = ShardPlan()
        plan.add("layers.0.w13", torch.uint8, (8, 4096))
        with ShardWriter(tmp / "experts-00001.safetensors", plan) as w:
            sha = w.write("layers.0.w13", packed)       # hex sha256 of the tensor's bytes
    shard = open_shard("out/model-moepack/experts-00001.safetensors")   # validated, zero-copy
    shard.tensor("layers.0.w13")
"""

from .reader import (
    MAX_HEADER_BYTES,
    PAD_PREFIX,
    Header,
    Shard,
    TensorInfo,
    open_shard,
    read_safetensors_header,
    sha256_of,
    sha256_update,
)
from .atomic import atomic_directory
from .plan import (
    DATA_ALIGNMENT,
    DEFAULT_ALIGNMENT,
    FORMAT_NAME,
    FORMAT_VERSION,
    WRITER_DTYPES,
    PlanEntry,
    ShardPlan,
)
from .writer import ShardWriter

__all__ = [
    "DATA_ALIGNMENT",
    "DEFAULT_ALIGNMENT",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "PAD_PREFIX",
    "WRITER_DTYPES",
    "Header",
    "PlanEntry",
    "Shard",
    "ShardPlan",
    "ShardWriter",
    "TensorInfo",
    "atomic_directory",
    "open_shard",
    "read_safetensors_header",
    "sha256_of",
    "sha256_update",
]
