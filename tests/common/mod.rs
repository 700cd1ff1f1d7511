//! Helpers shared by the integration tests.

pub mod adam;

use spillover_core::pool::{Pool, PoolOptions};
use spillover_core::tier::View;

/// A small unlocked, lazily faulted pool: what a test needs, on any machine.
pub fn pool(capacity: u64) -> Pool {
    let mut o = PoolOptions::new(capacity);
    o.lock = false;
    o.huge_pages = false;
    o.prefault = false;
    Pool::new(&o).unwrap()
}

/// `n` bytes of a xorshift stream seeded by `seed`: every entry's bytes differ.
#[allow(dead_code)] // not every test binary uses every helper
pub fn pattern(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Fill a staging view.
#[allow(dead_code)]
pub fn write(v: &View, bytes: &[u8]) {
    assert_eq!(v.len(), bytes.len());
    // SAFETY: a staging view is the test's to fill; nothing else reads or writes it yet.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_ptr(), bytes.len()) };
}
