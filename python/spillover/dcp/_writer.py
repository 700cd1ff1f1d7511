"""spillover.dcp.FileSystemWriter: torch's DCP ``FileSystemWriter`` with bounded files.

Note [DCP's writer holds a file's tensors]
    torch's ``FileSystemWriter`` keeps a reference to every tensor it wrote into a file until
    the file is closed (``_write_files_from_queue`` collects them in ``tensor_dict`` for the
    safetensors format, even when writing torch.save records), and with the default
    ``single_file_per_rank=True`` a rank writes one file (per ``thread_count``). However lazily
    the chunks are produced, the whole shard is then resident at the end of the save.
    :class:`FileSystemWriter` here is torch's, with the rank's items split into files of at
    most ``file_bytes`` each, so at most one file's worth of chunks is held at a time; it also
    resolves items in plan order (``per_thread_copy_ahead=0``: torch's overlapping loader, used
    when CUDA is available, sorts items by size and resolves ahead, which would make the
    optimizer export a unit once per piece). The files it writes are ordinary DCP files:
    ``dcp.load`` with torch's reader reads them. torch's own writer works too, without the
    bound.
"""

from __future__ import annotations

import math
import queue
from typing import Any, List

import torch


def _make_writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter as _TorchWriter
    from torch.distributed.checkpoint.filesystem import _item_size
    from torch.distributed.checkpoint.planner import WriteItemType

    class FileSystemWriter(_TorchWriter):
        """torch's ``FileSystemWriter`` with each rank's items split into files of at most
        ``file_bytes`` (Note [DCP's writer holds a file's tensors]), items resolved in plan
        order. Other arguments as torch's."""

        def __init__(self, path: Any, *, file_bytes: int = 64 << 20, **kwargs: Any):
            kwargs.setdefault("per_thread_copy_ahead", 0)
            if kwargs.get("single_file_per_rank") is False:
                raise ValueError(
                    "spillover.dcp.FileSystemWriter bounds the bytes per file; use torch's "
                    "FileSystemWriter for one file per item"
                )
            super().__init__(path, **kwargs)
            if file_bytes <= 0:
                raise ValueError(f"file_bytes must be positive, got {file_bytes}")
            self.file_bytes = file_bytes

        def write_data(self, plan: Any, planner: Any) -> Any:
            from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

            prefix = plan.storage_data.prefix
            files: List[List[Any]] = [[]]
            size = 0
            for item in plan.items:
                n = 0 if item.type == WriteItemType.BYTE_IO else _item_size(item)
                n = min(n, _chunk_bytes(item))
                if files[-1] and size + n > self.file_bytes:
                    files.append([])
                    size = 0
                files[-1].append(item)
                size += n
            q: queue.Queue = queue.Queue()
            for k, items in enumerate(files):
                name = f"{prefix}{k}{DEFAULT_SUFFIX}"
                q.put((self.fs.concat_path(self.path, name), name, items))
            return self._write_data(planner, q)

    FileSystemWriter.__module__ = __name__.rpartition(".")[0]  # spillover.dcp
    FileSystemWriter.__qualname__ = "FileSystemWriter"
    return FileSystemWriter


def _chunk_bytes(item: Any) -> int:
    """Bytes of a write item's chunk (``_item_size`` counts the whole tensor's)."""
    td = item.tensor_data
    if td is None or td.chunk is None:
        return 0
    return math.prod(td.chunk.sizes) * torch._utils._element_size(td.properties.dtype)
