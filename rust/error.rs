//! The crate's one error type: a variant per thing a caller can act on.

use std::fmt;
use std::io;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug)]
pub enum Error {
    /// The host pool has no free extent of `need` bytes (the tensor stays where it is).
    PoolExhausted {
        need: u64,
        largest_free: u64,
        capacity: u64,
    },
    /// Mapping an arena failed (the whole pool is refused).
    Map { bytes: u64, source: io::Error },
    /// A system call on a swap file or directory failed.
    Io {
        op: &'static str,
        path: PathBuf,
        offset: u64,
        source: io::Error,
    },
    /// A swap directory has no room for `need` more bytes.
    OutOfSpace { path: PathBuf, need: u64, free: u64 },
    /// Data read back does not match the checksum taken when it was written.
    Integrity { key: u64, expected: u32, found: u32 },
    /// A caller passed something unusable (a size of zero, an unknown key, ...).
    Invalid(String),
    /// Verify mode: the bytes a device-to-host copy landed do not match the checksum taken on
    /// the device, in stream order, before the copy (Note [device checksum]).
    Landed { id: u64, device: u32, host: u32 },
    /// The device refused a call or a copy failed on it (`op`: what was being done).
    Device { op: &'static str, detail: String },
    /// One of spillover's own invariants did not hold (a bug: Note [no panic across the
    /// boundary]). The call that found it fails; the tier and every other entry stay usable.
    Internal(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::PoolExhausted {
                need,
                largest_free,
                capacity,
            } => write!(
                f,
                "host pool exhausted: need {need} bytes, largest free extent {largest_free} of \
                 {capacity}; raise SPILLOVER_HOST_POOL_BYTES"
            ),
            Error::Map { bytes, source } => {
                write!(f, "could not map a {bytes}-byte host arena: {source}")
            }
            Error::Io {
                op,
                path,
                offset,
                source,
            } => write!(
                f,
                "{op} on {} at offset {offset} failed: {source}",
                path.display()
            ),
            Error::OutOfSpace { path, need, free } => write!(
                f,
                "out of space in {}: need {need} bytes, {free} free; free disk space or add a \
                 directory to SPILLOVER_NVME_PATH",
                path.display()
            ),
            Error::Integrity {
                key,
                expected,
                found,
            } => write!(
                f,
                "checksum mismatch for entry {key}: wrote crc32c {expected:#010x}, read back \
                 {found:#010x}"
            ),
            Error::Invalid(msg) => f.write_str(msg),
            Error::Landed { id, device, host } => write!(
                f,
                "copy {id}: the bytes that landed on the host (checksum {host:#010x}) are not \
                 those on the device before the copy ({device:#010x}): the source was written \
                 before its copy read it"
            ),
            Error::Device { op, detail } => write!(f, "device {op} failed: {detail}"),
            Error::Internal(what) => write!(
                f,
                "internal error in spillover: {what}. The operation that hit it failed; other \
                 offloaded tensors are intact and the next step can run. Please report it with \
                 the traceback (SPILLOVER_LOG=debug adds detail)"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Map { source, .. } | Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
