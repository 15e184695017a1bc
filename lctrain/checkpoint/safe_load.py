"""Reading checkpoint files without running code that a file could carry: nothing is unpickled.
lctrain's own files are JSON and safetensors, DCP's tensors are read with ``weights_only``, DCP's
pickled "bytes" entries are never written nor read, and DCP's ``.metadata`` is read by
`MetadataUnpickler`, which resolves only the names such a file holds."""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lctrain.errors import UserError

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"}, "torch": {"Size"}, "collections": {"OrderedDict"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}}
"""module -> names that a DCP ``.metadata`` file may resolve (plus torch's dtypes)."""


class UnsafeCheckpoint(UserError):
    """A checkpoint file names something that loading it would run."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the names of `_METADATA_CLASSES` and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"refusing to load {module}.{name}")


def load_metadata(data: bytes, where: str) -> Any:
    """DCP metadata from the bytes of a ``.metadata`` file, through `MetadataUnpickler`
    (UnsafeCheckpoint: it names something else; UserError: not a readable pickle)."""
    try:
        return MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpoint as error:
        raise UnsafeCheckpoint(f"{where} is not a checkpoint's metadata as lctrain writes it "
                               f"({error}); it was altered or comes from another program, and "
                               "lctrain does not load it") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as error:
        raise UserError(f"{where} cannot be read ({type(error).__name__}); the checkpoint is "
                        "damaged or incomplete") from None


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by `load_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as error:
            raise UserError(f"{path} cannot be read ({error.strerror or type(error).__name__}); "
                            "the checkpoint is incomplete or not lctrain's") from None
        metadata = load_metadata(data, str(path))
        if not isinstance(metadata, Metadata):
            raise UserError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing non-tensor ("bytes") entries: DCP reads those with
    ``torch.load(weights_only=False)``, i.e. plain pickle."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise UnsafeCheckpoint(f"the checkpoint entry {read_item.dest_index.fqn} is a pickled "
                               "object, which lctrain never writes and does not load")
