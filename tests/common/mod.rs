//! Helpers shared by the integration tests.

use spillover_core::pool::{Pool, PoolOptions};

/// A small unlocked, lazily faulted pool: what a test needs, on any machine.
pub fn pool(capacity: u64) -> Pool {
    let mut o = PoolOptions::new(capacity);
    o.lock = false;
    o.huge_pages = false;
    o.prefault = false;
    Pool::new(&o).unwrap()
}
