//! The verify mode's checksum of a storage's bytes (Note [device checksum]), on the host. The
//! same function runs on the device as a few torch ops (`activations/verify.py`), so that a
//! checksum taken where the bytes are (the device at pack, the device after the copy back)
//! can be compared with one of the host's copy without moving the bytes again.
//!
//! # Note [device checksum]
//! The bytes, zero-padded to a whole number of 4 KiB rows, are read as little-endian u32
//! words `w[r][j]` (row `r`, word `j` of 1024). With `P = 2^31 - 1` (prime):
//!
//! ```text
//! row(r) = sum_j w[r][j] * (2j + 1)                    (exact: < 2^53)
//! sum    = sum_r ((row(r) mod P) * ((2r + 1) mod P)) mod P,   summed mod P
//! ```
//!
//! Every intermediate fits an i64 exactly (so torch's int64 ops on any device give the same
//! value, in any reduction order, and no overflow is relied on). One changed byte always
//! changes the sum: the change of its word, times odd weights below `P`, is not a multiple of
//! the prime `P`. A permutation of rows or of words within a row changes it too (the weights
//! differ). It is not a cryptographic hash: it catches torn, stale and reordered bytes.

/// The prime modulus of Note [device checksum].
pub const P: u64 = (1 << 31) - 1;
/// Words per row (4 KiB).
pub const ROW_WORDS: usize = 1024;

/// Note [device checksum] of `bytes`.
pub fn checksum(bytes: &[u8]) -> u32 {
    let mut acc: u64 = 0;
    for (r, row) in bytes.chunks(ROW_WORDS * 4).enumerate() {
        let mut s: u64 = 0;
        let mut words = row.chunks_exact(4);
        for (j, w) in words.by_ref().enumerate() {
            let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as u64;
            s += w * (2 * j as u64 + 1);
        }
        let tail = words.remainder();
        if !tail.is_empty() {
            let mut b = [0u8; 4];
            b[..tail.len()].copy_from_slice(tail);
            let j = row.len() / 4;
            s += u32::from_le_bytes(b) as u64 * (2 * j as u64 + 1);
        }
        let weight = (2 * r as u64 + 1) % P;
        acc = (acc + (s % P) * weight % P) % P;
    }
    acc as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_padding_does_not_change_the_sum() {
        let a: Vec<u8> = (0..10_001u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut b = a.clone();
        b.resize(12 * 1024, 0);
        assert_eq!(checksum(&a), checksum(&b));
    }

    #[test]
    fn any_one_byte_changed_is_seen() {
        let a: Vec<u8> = (0..9000u32).map(|i| (i * 31 + 1) as u8).collect();
        let base = checksum(&a);
        for i in (0..a.len()).step_by(97) {
            for flip in [1u8, 0x80, 0xff] {
                let mut b = a.clone();
                b[i] ^= flip;
                assert_ne!(checksum(&b), base, "byte {i} ^ {flip:#x}");
            }
        }
    }

    #[test]
    fn swapped_rows_and_words_are_seen() {
        let a: Vec<u8> = (0..16384u32).map(|i| (i % 251) as u8).collect();
        let mut rows = a.clone();
        rows[..4096].copy_from_slice(&a[4096..8192]);
        rows[4096..8192].copy_from_slice(&a[..4096]);
        assert_ne!(checksum(&rows), checksum(&a));
        let mut words = a.clone();
        words[..4].copy_from_slice(&a[4..8]);
        words[4..8].copy_from_slice(&a[..4]);
        assert_ne!(checksum(&words), checksum(&a));
    }

    #[test]
    fn large_words_stay_exact() {
        let a = vec![0xffu8; 3 * 4096 + 5];
        // by hand: every full row sums 0xffffffff * 1024^2; the last row 1 word + a tail
        let full = (0xffff_ffffu64 * (1024 * 1024)) % P;
        let mut expect = 0u64;
        for r in 0..3u64 {
            expect = (expect + full * ((2 * r + 1) % P) % P) % P;
        }
        let last = (0xffff_ffffu64 + 0xffu64 * 3) % P;
        expect = (expect + last * 7 % P) % P;
        assert_eq!(checksum(&a) as u64, expect);
    }
}
