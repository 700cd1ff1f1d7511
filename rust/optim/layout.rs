//! Where each unit's optimizer state lives: pure arithmetic over element counts, no memory.
//!
//! A *unit* is a run of elements the optimizer updates as one (a parameter, or the part of a
//! parameter a rank owns). Units are laid end to end in one flat index space, each starting on
//! a multiple of the layout's alignment ([`ALIGN`] elements, so every unit's state starts on a
//! cache line; [`BLOCK`] for 8-bit state, Note [block alignment]). The
//! space is cut into *chunks* of `chunk_elems` elements; a chunk is the unit of storage (one
//! pool block on the host tier, one swap slot on the NVMe tier) and of streaming. A chunk
//! stores its columns one after the other (`[master] exp_avg exp_avg_sq [exp_avg_scale
//! exp_avg_sq_scale]`, [`Layout::columns`]), so a unit's piece inside a chunk is `len`
//! contiguous elements in every column (and `len / BLOCK` scales).
//!
//! # Note [block alignment]
//! 8-bit state has one scale per block of [`BLOCK`] elements (Note [8-bit moments] in
//! quant.rs), blocks counted from a unit's first element. So that a block never straddles two
//! units, two chunks or two tasks, units of 8-bit state start on multiples of `BLOCK` in the
//! flat space, chunks hold a multiple of `BLOCK` elements, and tasks are cut at multiples of
//! it. Python makes units start on multiples of `BLOCK` inside their parameter too (sharded
//! layouts pad each parameter to a block, staging units are a multiple of it): the blocks are
//! then the same runs of a parameter's elements for every tier, chunk size, path and world
//! size, and so is the state, bit for bit. bf16 state needs no blocks: its random bits follow
//! each element's key, whatever the layout (Note [stochastic rounding]).

use super::quant::{blocks, StateBits, BLOCK};

/// Units of fp32 state start on multiples of this many elements (64 bytes of f32).
pub const ALIGN: usize = 16;

/// Padding after each column of a chunk, in elements (17 cache lines).
///
/// # Note [column skew]
/// Without it the columns of a chunk sit an exact power-of-two-ish multiple of a large size
/// apart, and in a huge-page-backed pool block (physically contiguous 2 MiB) element `i` of
/// every column then maps to the same cache set and DRAM bank: measured at 100M parameters on
/// this project's CPU machine, steps were 6% slower in pool blocks than in 4 KiB heap pages.
/// Skewing each column by an odd number of cache lines (not a multiple of 4 KiB either)
/// removes the difference.
pub const COL_SKEW: usize = 17 * ALIGN;

/// [`COL_SKEW`] in bytes: the gap after every column, whatever its element size.
const SKEW_BYTES: usize = 4 * COL_SKEW;

/// Byte offsets of one chunk's columns (Note [column skew]); `None` for a column the state
/// does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Columns {
    pub master: Option<usize>,
    pub exp_avg: usize,
    pub exp_avg_sq: usize,
    /// One f32 per [`BLOCK`] elements (8-bit state).
    pub exp_avg_scale: Option<usize>,
    pub exp_avg_sq_scale: Option<usize>,
    /// The chunk's size.
    pub bytes: usize,
}

/// A unit's piece inside one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub unit: usize,
    pub chunk: usize,
    /// Element offset of the piece inside the chunk's columns.
    pub chunk_off: usize,
    /// Element offset of the piece inside the unit.
    pub unit_off: usize,
    pub len: usize,
}

#[derive(Debug, Clone)]
pub struct Layout {
    chunk_elems: usize,
    align: usize,
    lens: Vec<usize>,
    /// Start of each unit in the flat space.
    starts: Vec<usize>,
    /// End of the last unit (not rounded to a chunk).
    total: usize,
}

impl Layout {
    /// Units aligned to [`ALIGN`] (fp32 state); `chunk_elems` must be a positive multiple of it.
    pub fn new(unit_lens: &[usize], chunk_elems: usize) -> Result<Layout, String> {
        Layout::aligned(unit_lens, chunk_elems, ALIGN)
    }

    /// The alignment state stored as `bits` needs (Note [block alignment]).
    pub fn align_for(bits: StateBits) -> usize {
        match bits {
            StateBits::F32 | StateBits::Bf16 => ALIGN,
            StateBits::Q8 => BLOCK,
        }
    }

    /// Units starting on multiples of `align` elements (a multiple of [`ALIGN`]);
    /// `chunk_elems` must be a positive multiple of `align`.
    pub fn aligned(
        unit_lens: &[usize],
        chunk_elems: usize,
        align: usize,
    ) -> Result<Layout, String> {
        if align == 0 || align % ALIGN != 0 {
            return Err(format!(
                "alignment must be a multiple of {ALIGN} elements, got {align}"
            ));
        }
        if chunk_elems == 0 || chunk_elems % align != 0 {
            return Err(format!(
                "chunk size must be a positive multiple of {align} elements, got {chunk_elems}"
            ));
        }
        let mut starts = Vec::with_capacity(unit_lens.len());
        let mut at = 0usize;
        for &n in unit_lens {
            starts.push(at);
            at = at
                .checked_add(n.next_multiple_of(align))
                .ok_or_else(|| "optimizer state size overflows".to_string())?;
        }
        Ok(Layout {
            chunk_elems,
            align,
            lens: unit_lens.to_vec(),
            starts,
            total: at,
        })
    }

    pub fn chunk_elems(&self) -> usize {
        self.chunk_elems
    }

    /// Units start on multiples of this many elements.
    pub fn align(&self) -> usize {
        self.align
    }

    pub fn units(&self) -> usize {
        self.lens.len()
    }

    pub fn unit_len(&self, unit: usize) -> usize {
        self.lens[unit]
    }

    /// Elements of the flat space in use (units and their alignment padding).
    pub fn total(&self) -> usize {
        self.total
    }

    pub fn chunks(&self) -> usize {
        self.total.div_ceil(self.chunk_elems)
    }

    /// Elements of chunk `c` that hold units (the last chunk may be shorter).
    pub fn chunk_len(&self, c: usize) -> usize {
        (self.total - c * self.chunk_elems).min(self.chunk_elems)
    }

    /// Distance between the starts of two columns of chunk `c` in fp32 state, in elements
    /// (Note [column skew]); a chunk of `cols` such columns holds `cols * col_stride(c)` f32.
    pub fn col_stride(&self, c: usize) -> usize {
        self.chunk_len(c) + COL_SKEW
    }

    /// Where chunk `c`'s columns start, in bytes, for state with (`master`) an fp32 master
    /// column and moments stored as `bits`. Each column ends on a cache line and is followed
    /// by [`COL_SKEW`] f32 of padding (Note [column skew]): for fp32 state the columns are
    /// [`Layout::col_stride`] f32 apart.
    pub fn columns(&self, c: usize, master: bool, bits: StateBits) -> Columns {
        let n = self.chunk_len(c);
        let mut at = 0usize;
        let mut col = |bytes: usize| {
            let start = at;
            at = (at + bytes).next_multiple_of(64) + SKEW_BYTES;
            start
        };
        let m = bits.moment_size();
        let master = master.then(|| col(4 * n));
        let exp_avg = col(m * n);
        let exp_avg_sq = col(m * n);
        let (exp_avg_scale, exp_avg_sq_scale) = if bits.has_scales() {
            (Some(col(4 * blocks(n))), Some(col(4 * blocks(n))))
        } else {
            (None, None)
        };
        Columns {
            master,
            exp_avg,
            exp_avg_sq,
            exp_avg_scale,
            exp_avg_sq_scale,
            bytes: at,
        }
    }

    /// The pieces of `unit`, in unit order.
    pub fn pieces(&self, unit: usize) -> impl Iterator<Item = Piece> + '_ {
        let start = self.starts[unit];
        let len = self.lens[unit];
        let ce = self.chunk_elems;
        let mut off = 0usize;
        std::iter::from_fn(move || {
            if off >= len {
                return None;
            }
            let at = start + off;
            let chunk = at / ce;
            let chunk_off = at % ce;
            let n = (len - off).min(ce - chunk_off);
            let p = Piece {
                unit,
                chunk,
                chunk_off,
                unit_off: off,
                len: n,
            };
            off += n;
            Some(p)
        })
    }

    /// The chunks `unit` touches, as a range.
    pub fn unit_chunks(&self, unit: usize) -> std::ops::Range<usize> {
        let start = self.starts[unit];
        let first = start / self.chunk_elems;
        match self.lens[unit] {
            0 => first..first,
            len => first..(start + len).div_ceil(self.chunk_elems),
        }
    }
}

/// Cut `[0, len)` into pieces of at most `max` elements whose interior boundaries fall on
/// multiples of `align` (so a task never splits a cache line, or a block of low-bit state,
/// with its neighbour).
pub fn split_even(len: usize, max: usize, align: usize) -> impl Iterator<Item = (usize, usize)> {
    let max = max.max(align) / align * align;
    let mut off = 0usize;
    std::iter::from_fn(move || {
        if off >= len {
            return None;
        }
        let n = (len - off).min(max);
        let r = (off, n);
        off += n;
        Some(r)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_each_unit_once_and_never_overlap() {
        let lens = [5, 0, 40, 17, 100, 1];
        let l = Layout::new(&lens, 32).unwrap();
        let mut seen = vec![0u8; l.chunks() * 32];
        for (u, &n) in lens.iter().enumerate() {
            let mut covered = 0;
            for p in l.pieces(u) {
                assert_eq!(p.unit_off, covered);
                assert!(p.chunk_off + p.len <= l.chunk_len(p.chunk));
                assert!(l.unit_chunks(u).contains(&p.chunk));
                covered += p.len;
                for i in 0..p.len {
                    let at = p.chunk * 32 + p.chunk_off + i;
                    assert_eq!(seen[at], 0);
                    seen[at] = 1;
                }
            }
            assert_eq!(covered, n);
        }
        // Each unit rounded up to 16 elements (the empty one takes none).
        assert_eq!(l.total(), 16 + 48 + 32 + 112 + 16);
    }

    #[test]
    fn bad_chunk_sizes_are_refused() {
        assert!(Layout::new(&[1], 0).is_err());
        assert!(Layout::new(&[1], 17).is_err());
    }

    #[test]
    fn split_even_respects_alignment() {
        let parts: Vec<_> = split_even(100, 40, ALIGN).collect();
        assert_eq!(parts, vec![(0, 32), (32, 32), (64, 32), (96, 4)]);
        assert_eq!(split_even(0, 40, ALIGN).count(), 0);
        let parts: Vec<_> = split_even(1000, 300, BLOCK).collect();
        assert_eq!(parts, vec![(0, 256), (256, 256), (512, 256), (768, 232)]);
    }

    #[test]
    fn fp32_columns_are_col_stride_apart() {
        let l = Layout::new(&[1000, 7, 4099], 2048).unwrap();
        for c in 0..l.chunks() {
            let f = l.col_stride(c) * 4;
            let cols = l.columns(c, true, StateBits::F32);
            assert_eq!(
                (cols.master, cols.exp_avg, cols.exp_avg_sq),
                (Some(0), f, 2 * f)
            );
            assert_eq!(cols.bytes, 3 * f);
            let cols = l.columns(c, false, StateBits::F32);
            assert_eq!((cols.master, cols.exp_avg, cols.bytes), (None, 0, 2 * f));
        }
    }

    #[test]
    fn eight_bit_units_start_on_blocks_and_columns_fit() {
        assert!(Layout::aligned(&[1], 1000, BLOCK).is_err()); // chunks must hold whole blocks
        let l = Layout::aligned(&[1000, 1, 300], 1024, BLOCK).unwrap();
        assert_eq!(l.total(), 1024 + 256 + 512);
        for u in 0..3 {
            assert!(l
                .pieces(u)
                .all(|p| p.chunk_off % BLOCK == 0 && p.unit_off % BLOCK == 0));
        }
        for (bits, per) in [(StateBits::Bf16, 2), (StateBits::Q8, 1)] {
            let c = l.columns(0, true, bits);
            let n = l.chunk_len(0);
            assert_eq!(c.exp_avg, 4 * n + SKEW_BYTES);
            assert!(c.exp_avg_sq >= c.exp_avg + per * n + SKEW_BYTES);
            assert_eq!(c.exp_avg_scale.is_some(), bits == StateBits::Q8);
            if let (Some(a), Some(b)) = (c.exp_avg_scale, c.exp_avg_sq_scale) {
                assert!(a >= c.exp_avg_sq + n && b >= a + 4 * blocks(n) && c.bytes >= b);
            }
            assert!(c.bytes < 4 * n + 2 * per * n + 8 * blocks(n) + 6 * (SKEW_BYTES + 64));
        }
    }
}
