"""Every knob spillover has, read from SPILLOVER_* environment variables or keyword arguments.

Keyword arguments override the environment, which overrides the defaults. Sizes accept bytes
(``1048576``) or units (``512MiB``, ``8GiB``, ``1.5GB``). An unknown SPILLOVER_* name (a typo)
or a bad value raises :class:`~spillover.ConfigError` naming the variable and the value.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from .errors import ConfigError

__all__ = ["Config", "parse_size", "format_size", "ENV_NAMES"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, name: str = "size") -> int:
    """``"8GiB"`` → 8589934592. Accepts ints, digit strings and a number with a unit."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: expected a size such as 1048576, 512MiB or 8GiB")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}={value!r}: a size cannot be negative")
        return value
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(
            f"{name}={value!r}: expected a size such as 1048576, 512MiB or 8GiB "
            f"(units: {', '.join(u for u in _UNITS if u)})"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: Optional[float]) -> str:
    """1536 → '1.5 KiB'."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _choice(*allowed: str) -> Callable[[Any, str], str]:
    def parse(value: Any, name: str) -> str:
        v = str(value).strip().lower().replace("-", "_")
        if v == "iouring":
            v = "io_uring"
        if v not in allowed:
            raise ConfigError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
        return v

    return parse


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}={value!r}: expected 0/1, true/false, yes/no or on/off")


def _posint(value: Any, name: str) -> int:
    try:
        v = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        v = -1
    if isinstance(value, bool) or v <= 0:
        raise ConfigError(f"{name}={value!r}: expected a whole number > 0")
    return v


def _size(value: Any, name: str) -> int:
    return parse_size(value, name)


def _opt_size(value: Any, name: str) -> Optional[int]:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    return parse_size(value, name)


def _positive(parse: Callable[[Any, str], Any], what: str) -> Callable[[Any, str], Any]:
    """``parse``, refusing 0 (a size where nothing would work: a pool of no bytes)."""

    def check(value: Any, name: str) -> Any:
        v = parse(value, name)
        if v == 0:
            raise ConfigError(f"{name}={value!r}: {what} must be more than 0 bytes; "
                              f"{_HINTS.get(name.removeprefix('SPILLOVER_').lower(), '')}")
        return v

    return check


#: what to do instead of a size of 0, per setting
_HINTS = {
    "host_pool_bytes": "leave it unset for the default pool (64 MiB, grown to what steps hold), "
                       "or give a size such as 512MiB",
    "optim_pool_bytes": "leave it unset for what the parameters' state needs, or give a size "
                        "such as 1GiB",
    "io_block_bytes": "leave it unset for 1 MiB",
    "sim_link_bandwidth": "leave it unset for no simulated device",
}


_PLACEHOLDER_RE = re.compile(r"\{([^{}]*)\}")
_RANK_RE = re.compile(r"^\s*(local_rank|rank)\s*(?:%\s*(\d+)\s*)?$")


def rank_placeholders(path: str, name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """``/mnt/nvme{local_rank}/spill`` → ``/mnt/nvme3/spill`` on local rank 3 (LOCAL_RANK, as
    torchrun sets it; RANK for ``{rank}``; 0 when unset). ``{local_rank % 2}`` spreads 8 ranks
    over 2 drives."""
    env = os.environ if environ is None else environ

    def sub(m: re.Match) -> str:
        r = _RANK_RE.match(m.group(1))
        if r is None:
            raise ConfigError(
                f"{name}={path!r}: unknown placeholder {m.group(0)}; use {{local_rank}}, "
                "{rank} or {local_rank % N} (N drives)"
            )
        var = "LOCAL_RANK" if r.group(1) == "local_rank" else "RANK"
        raw = env.get(var, "0").strip() or "0"
        if not raw.isdigit():
            raise ConfigError(f"{name}={path!r}: {var}={raw!r} is not a rank number")
        value = int(raw)
        if r.group(2) is not None:
            if int(r.group(2)) == 0:
                raise ConfigError(f"{name}={path!r}: {m.group(0)} divides by zero")
            value %= int(r.group(2))
        return str(value)

    return _PLACEHOLDER_RE.sub(sub, path)


def _seconds(value: Any, name: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = -1.0
    if not v >= 0:
        raise ConfigError(f"{name}={value!r}: expected a number of seconds >= 0")
    return v


def _paths(value: Any, name: str) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        parts = [str(p) for p in value]
    else:
        parts = [p for p in str(value).split(",")]
    parts = [os.path.expanduser(rank_placeholders(p.strip(), name)) for p in parts if p.strip()]
    if not parts:
        return None
    return tuple(parts)


def _level(value: Any, name: str) -> str:
    v = str(value).strip().upper()
    if v not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"{name}={value!r}: expected debug, info, warning, error or critical")
    return v


# field name -> (parser, default). The env name is SPILLOVER_<FIELD NAME UPPERCASED>.
_FIELDS: Dict[str, Tuple[Callable[[Any, str], Any], Any, str]] = {
    "tier": (_choice("host", "nvme", "auto"), "auto", "where offloaded activations go"),
    "nvme_path": (_paths, None, "swap directories, comma-separated; {local_rank}, {rank} and "
                  "{local_rank % N} are replaced per rank (default: private temp dir)"),
    "host_pool_bytes": (_positive(_opt_size, "the host pool"), None,
                        "activation pool per process (default: 64 MiB, grown to what steps "
                        "hold, up to the rank's share of RAM / 4 and 8 GiB)"),
    "optim_pool_bytes": (_positive(_opt_size, "the optimizer's pool"), None,
                         "OffloadAdamW's pool per process (default: what its parameters' "
                         "state needs, at most the rank's share of RAM / 4 and 8 GiB)"),
    "min_offload_bytes": (_size, 1 << 20, "saved tensors smaller than this stay put"),
    "prefetch_bytes": (_opt_size, None, "read-ahead window (default: derived from bandwidth)"),
    "io_engine": (_choice("io_uring", "threads", "auto"), "auto", "swap I/O engine"),
    "io_queue_depth": (_posint, 32, "I/O requests kept in flight"),
    "io_block_bytes": (_positive(_size, "an I/O request"), 1 << 20, "I/O request size"),
    "allow_buffered_io": (_bool, False, "fall back to buffered I/O where O_DIRECT is refused"),
    "device_budget_bytes": (_opt_size, None, "activation memory the planner may keep on device"),
    "copy_inflight_bytes": (_opt_size, None,
                            "device->host copies in flight before pack waits (default: the "
                            "link's bandwidth x 20 ms)"),
    "sim_link_bandwidth": (_positive(_opt_size, "a simulated link's bandwidth"), None,
                           "bytes/s of a simulated device link for CPU tensors (tests; off)"),
    "sim_compute_lag": (_seconds, 0.0,
                        "seconds the simulated device's compute stream runs behind the host "
                        "(with sim_link_bandwidth; tests; 0)"),
    "sim_call_cost": (_seconds, 0.0,
                      "host seconds each call to the simulated device costs (with "
                      "sim_link_bandwidth: what a driver call costs the host; tests; 0)"),
    "write_from_tensor": (_bool, True,
                          "NVMe tier, CPU tensors: write a saved storage to disk from its own "
                          "memory, held until written (off: copy it into the pool first)"),
    "write_hold_bytes": (_opt_size, None,
                         "NVMe tier, CPU tensors: bytes being written to disk past which a pack "
                         "waits for the oldest write (default: the host pool's capacity plus "
                         "the largest storage written from its tensor so far)"),
    "rederive": (_bool, True,
                 "make a saved tensor again at unpack, instead of offloading it, where a cheap "
                 "op made it from tensors autograd holds anyway (SiLU, GELU, products)"),
    "verify": (_bool, False, "checksum every offloaded tensor and check it on reload"),
    "log": (_level, "WARNING", "log level of the 'spillover' logger"),
}

ENV_NAMES = tuple(f"SPILLOVER_{k.upper()}" for k in _FIELDS)


@dataclasses.dataclass(frozen=True)
class Config:
    """The effective configuration. Build it with :meth:`Config.load`."""

    tier: str = "auto"
    nvme_path: Optional[Tuple[str, ...]] = None
    host_pool_bytes: Optional[int] = None
    optim_pool_bytes: Optional[int] = None
    min_offload_bytes: int = 1 << 20
    prefetch_bytes: Optional[int] = None
    io_engine: str = "auto"
    io_queue_depth: int = 32
    io_block_bytes: int = 1 << 20
    allow_buffered_io: bool = False
    device_budget_bytes: Optional[int] = None
    copy_inflight_bytes: Optional[int] = None
    sim_link_bandwidth: Optional[int] = None
    sim_compute_lag: float = 0.0
    sim_call_cost: float = 0.0
    write_from_tensor: bool = True
    write_hold_bytes: Optional[int] = None
    rederive: bool = True
    verify: bool = False
    log: str = "WARNING"
    #: field -> "keyword", "env" or "default": where each value came from (for `doctor`).
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    @classmethod
    def load(
        cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any
    ) -> Config:
        """Defaults, then SPILLOVER_* from ``environ`` (default ``os.environ``), then keywords.

        Keywords named ``None`` are ignored (so callers can pass optional arguments through).
        """
        env = os.environ if environ is None else environ
        unknown_env = sorted(k for k in env if k.startswith("SPILLOVER_") and k not in ENV_NAMES)
        if unknown_env:
            raise ConfigError(
                f"unknown environment variable {', '.join(unknown_env)}; "
                f"spillover reads: {', '.join(ENV_NAMES)}"
            )
        unknown_kw = sorted(k for k in overrides if k not in _FIELDS)
        if unknown_kw:
            raise ConfigError(
                f"unknown option {', '.join(unknown_kw)}; valid options: {', '.join(_FIELDS)}"
            )
        values: Dict[str, Any] = {}
        sources: Dict[str, str] = {}
        for field, (parse, default, _help) in _FIELDS.items():
            env_name = f"SPILLOVER_{field.upper()}"
            if overrides.get(field) is not None:
                values[field] = parse(overrides[field], field)
                sources[field] = "keyword"
            elif env_name in env:
                values[field] = parse(env[env_name], env_name)
                sources[field] = "env"
            else:
                values[field] = default
                sources[field] = "default"
        return cls(sources=sources, **values)

    def replace(self, **overrides: Any) -> Config:
        """A copy with keyword overrides applied (validated like :meth:`load`)."""
        unknown = sorted(k for k in overrides if k not in _FIELDS)
        if unknown:
            raise ConfigError(f"unknown option {', '.join(unknown)}; valid: {', '.join(_FIELDS)}")
        values = {}
        sources = dict(self.sources)
        for k, v in overrides.items():
            if v is not None:
                values[k] = _FIELDS[k][0](v, k)
                sources[k] = "keyword"
        return dataclasses.replace(self, sources=sources, **values)

    def describe(self) -> Dict[str, Tuple[str, Any, str, str]]:
        """env name -> (field, value, source, help), for ``python -m spillover doctor``."""
        return {
            f"SPILLOVER_{f.upper()}": (f, getattr(self, f), self.sources.get(f, "default"), h)
            for f, (_p, _d, h) in _FIELDS.items()
        }


_REDERIVE: Dict[Optional[str], bool] = {}


def rederive_enabled() -> bool:
    """``SPILLOVER_REDERIVE`` where no context says (the planner, and regions run without an
    offload context: Note [made again at unpack] in activations/rederive.py), parsed once per
    value."""
    raw = os.environ.get("SPILLOVER_REDERIVE")
    hit = _REDERIVE.get(raw)
    if hit is None:
        hit = _REDERIVE[raw] = True if raw is None else _bool(raw, "SPILLOVER_REDERIVE")
    return hit
