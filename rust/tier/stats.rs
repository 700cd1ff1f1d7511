//! The tier's knobs and counters: [`TierOptions`], [`StepStats`] (one step) and [`TierStats`]
//! (the whole tier).

/// Default read-ahead cap (the window is a quarter of the pool, at most this).
pub const DEFAULT_PREFETCH_CAP: u64 = 256 << 20;

/// Knobs of a tier.
#[derive(Debug, Clone)]
pub struct TierOptions {
    /// Write behind while more than this many bytes are not on disk.
    pub dirty_bytes: u64,
    /// Read-ahead window in backward.
    pub prefetch_bytes: u64,
    /// crc32c every entry at seal and check it at every `get`.
    pub verify: bool,
    /// Bytes being written (from the pool or from tensors) past which a put from a tensor
    /// waits for the oldest write; None: the pool's capacity and the largest storage written
    /// from a tensor so far (Note [written from the tensor], Memory).
    pub write_hold_bytes: Option<u64>,
}

impl TierOptions {
    /// Defaults for a pool of `capacity` bytes.
    pub fn for_pool(capacity: u64) -> TierOptions {
        TierOptions {
            dirty_bytes: capacity / 4,
            prefetch_bytes: (capacity / 4).min(DEFAULT_PREFETCH_CAP),
            verify: false,
            write_hold_bytes: None,
        }
    }
}

/// Counters of one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Bytes put (every entry, pieces included).
    pub bytes_put: u64,
    /// Bytes written to disk for the first time (an entry is counted once).
    pub bytes_written: u64,
    /// Unpacks of entries that had gone to disk and were back in the pool in time, or not.
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    /// Unpacks of entries that never left the pool.
    pub host_cache_hits: u64,
    /// Reads back that found no room in the pool and used a one-off buffer.
    pub overflow_reads: u64,
    /// Seconds `put`, `get` and gathering waited for the disk.
    pub stall_seconds: f64,
}

/// Counters of the whole tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    pub entries: u64,
    pub pool_capacity: u64,
    pub pool_in_use: u64,
    pub pool_peak: u64,
    /// Entries (and their bytes) by residency.
    pub staging: u64,
    pub dirty: u64,
    pub writing: u64,
    pub clean: u64,
    pub disk: u64,
    pub reading: u64,
    pub bytes_in_pool: u64,
    pub bytes_on_disk_only: u64,
    pub swap_in_use: u64,
    pub io_in_flight: u64,
}
