//! The vector operations the many-row 8-bit kernel (`int8_lanes`) is written in, for three kinds
//! of register: sixteen and eight i32/f32 lanes with AVX-512 VNNI (`Z16`, `Y8`: activations stored
//! as unsigned bytes q + 128, one `vpdpbusd` per four values, the units' bias correcting the 128),
//! and eight lanes with AVX2 alone (`A8`: activations stored as signed bytes, `vpmaddubsw` and
//! `vpmaddwd` in place of `vpdpbusd`, the weights' signs moved onto the activations where a
//! format's values are signed). Every way gives the same exact integer sums of four products —
//! no 16-bit pair saturates: |w| ≤ 128 against |x| ≤ 127 (`A8`), so the bits do not depend on the
//! CPU's instructions.
//!
//! Callers run where `int8_lanes::available()` holds for the register kind (the functions inline
//! into `int8_lanes`'s entry points, which enable the features).

use std::arch::x86_64::*;

/// A register kind of `N` i32/f32 lanes.
pub(super) trait Reg {
    const N: usize;
    /// Whether activations are stored as q + 128 (the units' `bias` then corrects each sum).
    const BIASED: bool;
    type I: Copy;
    type F: Copy;
    unsafe fn load_i(p: *const u8) -> Self::I;
    unsafe fn set_i(v: i32) -> Self::I;
    /// `acc` plus, per lane, the sum of the four products of `x`'s bytes (activations, as stored)
    /// with `w`'s (weights, signed bytes; `SIGNED` where they may be negative — unsigned formats'
    /// values are below 128 either way). `mag`: |w|'s bytes, which signed activations multiply
    /// (`pairs`; a register kind with biased activations ignores it).
    unsafe fn dp<const SIGNED: bool>(acc: Self::I, x: Self::I, w: Self::I, mag: Self::I)
        -> Self::I;
    /// For signed activations (`!BIASED`): per lane, the two 16-bit sums of two products of `x`'s
    /// and `w`'s bytes (`SIGNED` and `mag` as `dp`), which `add16` may add up while they stay
    /// below 2^15. (Registers whose activations are biased have no use for them.)
    unsafe fn pairs<const SIGNED: bool>(_x: Self::I, _w: Self::I, _mag: Self::I) -> Self::I {
        unreachable!("biased activations are multiplied by `dp`")
    }
    unsafe fn add16(_a: Self::I, _b: Self::I) -> Self::I {
        unreachable!("biased activations are multiplied by `dp`")
    }
    /// Per lane, the sum of its two 16-bit halves.
    unsafe fn widen(_p: Self::I) -> Self::I {
        unreachable!("biased activations are multiplied by `dp`")
    }
    unsafe fn mullo(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add_i(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn cvt(a: Self::I) -> Self::F;
    unsafe fn load_f(p: *const f32) -> Self::F;
    unsafe fn set_f(v: f32) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    unsafe fn store_f(p: *mut f32, a: Self::F);
}

/// Sixteen lanes: 512-bit registers (AVX-512 VNNI).
pub(super) struct Z16;
/// Eight lanes: 256-bit registers (AVX-512 VL's VNNI).
pub(super) struct Y8;
/// Eight lanes: 256-bit registers, AVX2 alone.
pub(super) struct A8;

macro_rules! reg {
    ($t:ty, $n:expr, $biased:expr, $i:ty, $f:ty, $load:ident, $set:ident, $mullo:ident,
     $addi:ident, $cvt:ident, $loadf:ident, $setf:ident, $mul:ident, $add:ident, $fma:ident,
     $store:ident, |$acc:ident, $x:ident, $w:ident, $mag:ident| $dp:expr $(, $extra:item)*) => {
        impl Reg for $t {
            const N: usize = $n;
            const BIASED: bool = $biased;
            type I = $i;
            type F = $f;
            #[inline(always)]
            unsafe fn load_i(p: *const u8) -> $i {
                $load(p as *const $i)
            }
            #[inline(always)]
            unsafe fn set_i(v: i32) -> $i {
                $set(v)
            }
            #[inline(always)]
            unsafe fn dp<const SIGNED: bool>($acc: $i, $x: $i, $w: $i, $mag: $i) -> $i {
                $dp
            }
            #[inline(always)]
            unsafe fn mullo(a: $i, b: $i) -> $i {
                $mullo(a, b)
            }
            #[inline(always)]
            unsafe fn add_i(a: $i, b: $i) -> $i {
                $addi(a, b)
            }
            #[inline(always)]
            unsafe fn cvt(a: $i) -> $f {
                $cvt(a)
            }
            #[inline(always)]
            unsafe fn load_f(p: *const f32) -> $f {
                $loadf(p)
            }
            #[inline(always)]
            unsafe fn set_f(v: f32) -> $f {
                $setf(v)
            }
            #[inline(always)]
            unsafe fn mul(a: $f, b: $f) -> $f {
                $mul(a, b)
            }
            #[inline(always)]
            unsafe fn add(a: $f, b: $f) -> $f {
                $add(a, b)
            }
            #[inline(always)]
            unsafe fn fmadd(a: $f, b: $f, c: $f) -> $f {
                $fma(a, b, c)
            }
            #[inline(always)]
            unsafe fn store_f(p: *mut f32, a: $f) {
                $store(p, a)
            }
            $($extra)*
        }
    };
}

reg!(
    Z16,
    16,
    true,
    __m512i,
    __m512,
    _mm512_load_si512,
    _mm512_set1_epi32,
    _mm512_mullo_epi32,
    _mm512_add_epi32,
    _mm512_cvtepi32_ps,
    _mm512_load_ps,
    _mm512_set1_ps,
    _mm512_mul_ps,
    _mm512_add_ps,
    _mm512_fmadd_ps,
    _mm512_storeu_ps,
    |acc, x, w, _mag| _mm512_dpbusd_epi32(acc, x, w)
);
/// `reg!` for a kind of eight lanes in 256-bit registers.
macro_rules! reg256 {
    ($t:ty, $biased:expr, |$acc:ident, $x:ident, $w:ident, $mag:ident| $dp:expr $(, $extra:item)*) => {
        reg!(
            $t,
            8,
            $biased,
            __m256i,
            __m256,
            _mm256_load_si256,
            _mm256_set1_epi32,
            _mm256_mullo_epi32,
            _mm256_add_epi32,
            _mm256_cvtepi32_ps,
            _mm256_load_ps,
            _mm256_set1_ps,
            _mm256_mul_ps,
            _mm256_add_ps,
            _mm256_fmadd_ps,
            _mm256_storeu_ps,
            |$acc, $x, $w, $mag| $dp
            $(, $extra)*
        );
    };
}

reg256!(Y8, true, |acc, x, w, _mag| _mm256_dpbusd_epi32(acc, x, w));
reg256!(
    A8,
    false,
    // Two products a pair: within 2·128·127 < 2^15, so no pair saturates.
    |acc, x, w, mag| _mm256_add_epi32(acc, Self::widen(Self::pairs::<SIGNED>(x, w, mag))),
    #[inline(always)]
    unsafe fn pairs<const SIGNED: bool>(x: __m256i, w: __m256i, mag: __m256i) -> __m256i {
        // `maddubs` takes its first operand unsigned: the weights' magnitudes (unpacked once a
        // step: `Unit::mag`), their signs moved onto the activations where they have any.
        // |w| ≤ 128, |x| ≤ 127.
        if SIGNED {
            _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, w))
        } else {
            _mm256_maddubs_epi16(w, x)
        }
    },
    #[inline(always)]
    unsafe fn add16(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi16(a, b)
    },
    #[inline(always)]
    unsafe fn widen(p: __m256i) -> __m256i {
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }
);
