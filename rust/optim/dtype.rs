//! The element types the AdamW kernel reads and writes: f32, and bf16 held as its bits.
//!
//! bf16 is converted as torch converts it: widening is exact, narrowing rounds to nearest even
//! (`c10::BFloat16`'s `round_to_nearest_even`), with NaN mapped to 0x7fc0.

/// A gradient element: f32, or bf16 held as its bits.
pub trait Grad: Copy + Send + Sync + 'static {
    fn widen(self) -> f32;
}

/// A model-parameter element written by the kernel.
pub trait Param: Copy + Send + Sync + 'static {
    fn narrow(x: f32) -> Self;
    fn widen(self) -> f32;
}

/// bf16 as its bit pattern (torch's `torch.bfloat16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Grad for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Param for f32 {
    #[inline(always)]
    fn narrow(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Grad for Bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        bf16_to_f32(self.0)
    }
}

impl Param for Bf16 {
    #[inline(always)]
    fn narrow(x: f32) -> Bf16 {
        Bf16(f32_to_bf16(x))
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        bf16_to_f32(self.0)
    }
}

/// Exact widening.
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round to nearest even, exactly as `c10::BFloat16(float)` (NaN becomes 0x7fc0).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    let rounded = (u.wrapping_add(((u >> 16) & 1) + 0x7fff) >> 16) as u16;
    if x.is_nan() {
        0x7fc0
    } else {
        rounded
    }
}

/// Widen `src` into `dst` (bf16 → f32 is exact).
pub fn widen_into<P: Param>(src: &[P], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.widen();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_torch_rules() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between two bf16 values with an even lower one: rounds down.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        // halfway with an odd lower one: rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::NAN), 0x7fc0);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // overflows to inf, as in torch
        for b in [0u16, 0x8000, 0x3f80, 0xc2f7, 0x0001, 0x7f7f] {
            assert_eq!(f32_to_bf16(bf16_to_f32(b)), b);
        }
    }
}
