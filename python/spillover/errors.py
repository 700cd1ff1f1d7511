"""spillover's exceptions: one base class, each subclassing the built-in a caller expects.

The Rust engine raises these too (``rust/py/errors.rs`` maps its error enum onto them), so
``except spillover.SpilloverError`` catches everything the library itself raises.
"""

from __future__ import annotations

__all__ = [
    "SpilloverError",
    "ConfigError",
    "PoolExhaustedError",
    "SwapIOError",
    "OutOfSpaceError",
    "IntegrityError",
    "DeviceError",
    "InternalError",
]


class SpilloverError(Exception):
    """Base of every error spillover raises."""


class ConfigError(SpilloverError, ValueError):
    """A SPILLOVER_* variable or keyword argument is unknown or has a bad value."""


class PoolExhaustedError(SpilloverError, MemoryError):
    """The pinned host pool has no free extent large enough.

    Inside ``offload_context`` this is not raised: the tensor stays where it is and the stats
    count it under ``kept_pool_full``. It reaches callers that lease blocks themselves.
    """

    def __init__(self, message: str, need: int = 0, largest_free: int = 0, capacity: int = 0):
        super().__init__(message)
        self.need = need
        self.largest_free = largest_free
        self.capacity = capacity


class SwapIOError(SpilloverError, OSError):
    """A read, write or open on a swap file failed; ``errno`` and the message say which."""


class OutOfSpaceError(SwapIOError):
    """A swap directory is full: ``path``, bytes ``need``-ed and bytes ``free`` are attached."""

    def __init__(self, message: str, path: str = "", need: int = 0, free: int = 0):
        import errno as _errno

        super().__init__(_errno.ENOSPC, message)
        self.path = path
        self.need = need
        self.free = free

    def __str__(self) -> str:
        return str(self.strerror)


class IntegrityError(SpilloverError, RuntimeError):
    """A tensor read back does not match the checksum taken when it was offloaded."""


class DeviceError(SpilloverError, RuntimeError):
    """The device refused a call of the link, or a copy failed on it (the message names the
    driver's error, e.g. ``CUDA_ERROR_ILLEGAL_ADDRESS``). A CUDA context that reported an
    asynchronous error is unusable: restart the process."""


class InternalError(SpilloverError, RuntimeError):
    """One of spillover's own invariants did not hold: a bug in spillover, not in your code.

    The operation that hit it failed; other offloaded tensors are intact and the next step can
    run (Note [no panic across the boundary], ``rust/py/errors.rs``). Please report it with the
    traceback.
    """
