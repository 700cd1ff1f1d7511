"""A stand-in of activations/link/cuda.py's CudaDevice for the optimizer's copies of CPU tensors
(``OffloadAdamW(_link=StreamLog())``): every call is logged in order and a copy runs at once, so
the stream ordering the optimizer asks for can be checked on CPU (Note [parameter writes are
ordered] and Note [sharded copies] in spillover/optim/)."""

from __future__ import annotations

import threading
from typing import Iterable, List, Tuple


class Event:
    __slots__ = ("stream", "at")

    def __init__(self, stream: str, at: int):
        self.stream, self.at = stream, at  # recorded after the first `at` log entries

    def __repr__(self) -> str:
        return f"Event({self.stream}@{self.at})"


class StreamLog:
    """Logs ``("copy", stream, dst storage address, nbytes)``, ``("record", stream, event)``,
    ``("wait", stream, event)``, ``("synchronize", event)`` and ``("record_stream", stream)``."""

    def __init__(self) -> None:
        self.log: List[Tuple] = []
        self._n = 0
        self._lock = threading.Lock()

    def _add(self, entry: Tuple) -> None:
        with self._lock:
            self.log.append(entry)

    def current_stream(self) -> str:
        return "compute"

    def new_stream(self) -> str:
        with self._lock:
            self._n += 1
            return f"copy{self._n}"

    def copy(self, dst, src, stream) -> None:
        dst.copy_(src)
        self._add(("copy", stream, dst.untyped_storage().data_ptr(),
                   dst.numel() * dst.element_size()))

    def record(self, stream) -> Event:
        with self._lock:
            ev = Event(stream, len(self.log))
            self.log.append(("record", stream, ev))
        return ev

    def wait(self, stream, ev) -> None:
        self._add(("wait", stream, ev))

    def synchronize(self, ev) -> None:
        self._add(("synchronize", ev))

    def record_stream(self, storage, stream) -> None:
        self._add(("record_stream", stream))

    def mark(self) -> int:
        """A point in the log (backward returned, step() returned)."""
        return len(self.log)


def unordered_writes(log: List[Tuple], storages: Iterable[int], upto: int) -> List[int]:
    """Log positions (before `upto`) of copies into one of `storages` on a side stream that the
    compute stream is not ordered after by `upto`: no ``wait("compute", ev)`` before `upto` with
    `ev` recorded on the copy's stream after the copy."""
    watched = set(storages)
    bad = []
    for i, e in enumerate(log[:upto]):
        if e[0] != "copy" or e[2] not in watched or e[1] == "compute":
            continue
        if not any(
            w[0] == "wait" and w[1] == "compute" and w[2].stream == e[1] and w[2].at > i
            for w in log[i + 1 : upto]
        ):
            bad.append(i)
    return bad
