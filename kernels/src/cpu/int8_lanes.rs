//! The 8-bit path for steps of many activation rows (prefill, large batches): activation rows side
//! by side in the lanes of one register — sixteen with AVX-512 VNNI, where one `vpdpbusd`
//! multiplies four values of a weight unit (broadcast) with the same four values of sixteen rows;
//! eight with AVX2 alone, `vpmaddubsw` + `vpmaddwd` in its place (`int8_regs`) — and a weight row
//! unpacked once per step (`int8_units`) however many rows there are.
//!
//! Each output is computed with the arithmetic of the one-row and few-row kernels (`int8_avx2`,
//! `int8_batch`, `int8_kq_avx2`) — the same exact integer sums (of a whole 32-value unit, or of a
//! 16-value half for Q3_K/Q6_K, or of four values for Q2_K), the same f32 products and fused adds
//! in the same order, the same final sum of eight partial sums — so a
//! sequence's row has the same bits whatever its step holds: one row or three hundred, a prefill
//! or a decode, alone or beside other sequences, and whichever CPU's instructions computed it.
//! Only the order in which outputs are computed differs.

use super::int8::{Q8Row, LANES_FROM, NARROW_FROM};
use super::int8_regs::{Reg, A8, Y8, Z16};
use super::int8_units::{form, signed, unpack, Form, Out, Unit};
use layerstream_types::DType;

/// Activation rows per group: the lanes of a 512-bit register of i32. A step's last group takes
/// a 256-bit register (`HALF` lanes) when it has no more rows than that, so a step of 5-8 rows
/// (a batched decode) or a prefill's last few rows do not pay for sixteen lanes.
pub const LANES: usize = 16;

/// Lanes of the narrow register (and of every group with AVX2 alone).
pub const HALF: usize = 8;

/// Weight rows unpacked at a time (8 rows of 4096 values: 96 KiB of units).
const TILE: usize = 8;

/// Weight rows `tile` takes at once for Q3_K/Q6_K (two integer chains a row: eight rows' sixteen
/// ran slower than four rows' eight).
const HALF_TILE: usize = 4;

/// The instructions a step's lanes are laid out for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Isa {
    /// AVX-512 VNNI: groups of sixteen (or eight) rows, activations as unsigned bytes.
    Vnni,
    /// AVX2 alone: groups of eight rows, activations as signed bytes.
    Avx2,
}

/// Sixteen lanes of four bytes (or two units' worth of eight lanes).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bytes64([u8; 64]);

/// Sixteen lanes of f32 (or two units' worth of eight lanes).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct F32x16([f32; 16]);

/// Up to `width` (16 or 8) quantized activation rows interleaved: for unit i and t in 0..8, the
/// four values 4t..4t+4 of each row as bytes (unsigned, q + 128, for `Isa::Vnni`; signed for
/// `Isa::Avx2`) in its lane, `4·width` bytes at byte `4·width·(8i + t)` of `x`; per unit the rows'
/// scales and d·Σq, `width` floats at float `width·i` of `dx` and `ds`. Rows past the real ones
/// are zeros with scale 0.
pub(super) struct Group {
    pub(super) rows: usize,
    pub(super) width: usize,
    x: Vec<Bytes64>,
    pub(super) dx: Vec<F32x16>,
    pub(super) ds: Vec<F32x16>,
    /// For AMX tiles (`int8_amx`): the rows one after another, `int8_amx::row_stride` bytes
    /// apart, as unsigned bytes (q + 128), sixteen rows (those past the real ones q = 0); else
    /// empty.
    pub(super) xa: Vec<u8>,
}

impl Group {
    /// `rows` (at most 16; 8 for `Isa::Avx2`) interleaved, in eight lanes where they fit.
    fn new(rows: &[Q8Row], units: usize, isa: Isa, amx: bool) -> Group {
        let width = if rows.len() <= HALF { HALF } else { LANES };
        let per = width / HALF; // a unit is 4·per 64-byte blocks of x, per/2 of dx and ds
                                // q + 128 for `Isa::Vnni` (zeros padding the lanes past the real rows too).
        let bias: u8 = if isa == Isa::Vnni { 0x80 } else { 0 };
        let mut g = Group {
            rows: rows.len(),
            width,
            x: vec![Bytes64([bias; 64]); units * 4 * per],
            dx: vec![F32x16([0.0; 16]); (units * per).div_ceil(2)],
            ds: vec![F32x16([0.0; 16]); (units * per).div_ceil(2)],
            xa: Vec::new(),
        };
        if amx {
            let (k, stride) = (32 * units, super::int8_amx::row_stride(units));
            g.xa = vec![0x80; LANES * stride];
            for (row, xa) in rows.iter().zip(g.xa.chunks_exact_mut(stride)) {
                for (o, &q) in xa.iter_mut().zip(&row.q[..k]) {
                    *o = (q as u8) ^ 0x80;
                }
            }
        }
        let x = g.x.as_mut_ptr() as *mut u8;
        let (dx, ds) = (g.dx.as_mut_ptr() as *mut f32, g.ds.as_mut_ptr() as *mut f32);
        for (lane, row) in rows.iter().enumerate() {
            for i in 0..units {
                let (d, q, s) = row.block(i);
                // SAFETY: lane < width and i < units: the offsets are inside the vectors sized
                // above (units·8·4·width bytes, units·width floats).
                unsafe {
                    *dx.add(width * i + lane) = d;
                    *ds.add(width * i + lane) = s;
                    for t in 0..8 {
                        let at = x.add(4 * width * (8 * i + t) + 4 * lane);
                        for (b, &v) in q[4 * t..4 * t + 4].iter().enumerate() {
                            *at.add(b) = (v as u8) ^ bias;
                        }
                    }
                }
            }
        }
        g
    }
}

/// Quantized activation rows laid out for `dot_lanes`, built once per step; below `LANES_FROM`
/// rows the rows themselves too, for the formats whose few-row kernel is faster (`lanes_pay`).
pub struct Q8Lanes {
    groups: Vec<Group>,
    units: usize,
    isa: Isa,
    few: Vec<Q8Row>,
    /// Whether the groups hold their rows for AMX tiles too (`int8_amx`).
    amx: bool,
}

impl Q8Lanes {
    /// Interleaves `xs` (each of `units` 32-value blocks at least) in groups for this CPU's
    /// instructions (`isa()`: one `available()`).
    pub fn new(xs: Vec<Q8Row>, units: usize) -> Q8Lanes {
        let isa = isa().expect("int8_lanes::available()");
        let amx = isa == Isa::Vnni && xs.len() >= super::int8_amx::AMX_FROM;
        Q8Lanes::laid_out(xs, units, isa, amx && super::int8_amx::available())
    }

    /// As `new`, laid out for `isa` (which the CPU must run: `Isa::Avx2` wherever `Isa::Vnni`),
    /// without AMX.
    pub fn for_isa(xs: Vec<Q8Row>, units: usize, isa: Isa) -> Q8Lanes {
        Q8Lanes::laid_out(xs, units, isa, false)
    }

    /// As `new`, for AMX tiles however few the rows (`int8_amx::available()` must hold).
    pub fn for_amx(xs: Vec<Q8Row>, units: usize) -> Q8Lanes {
        assert!(super::int8_amx::available(), "AMX tiles are not available here");
        Q8Lanes::laid_out(xs, units, Isa::Vnni, true)
    }

    fn laid_out(xs: Vec<Q8Row>, units: usize, isa: Isa, amx: bool) -> Q8Lanes {
        use rayon::prelude::*;
        let per = if isa == Isa::Vnni { LANES } else { HALF };
        let groups = xs.par_chunks(per).map(|rows| Group::new(rows, units, isa, amx)).collect();
        let few = if xs.len() < LANES_FROM { xs } else { Vec::new() };
        Q8Lanes { groups, units, isa, few, amx }
    }

    /// The groups of rows.
    pub(super) fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Activation rows held.
    pub fn rows(&self) -> usize {
        self.groups.iter().map(|g| g.rows).sum()
    }

    /// 32-value units per row.
    pub fn units(&self) -> usize {
        self.units
    }

    /// The rows for the few-row kernels where `dtype` is faster there at this many rows
    /// (`lanes_pay`; at eight rows too for the formats `int8_few` takes).
    pub fn few_rows(&self, dtype: DType) -> Option<&[Q8Row]> {
        let few = super::int8_few::takes(dtype, self.rows());
        (few || !lanes_pay(form(dtype), self.rows())).then_some(&self.few[..])
    }
}

/// Whether `m` rows of a step run faster here than in the few-row kernels (`int8_batch`): from
/// `LANES_FROM` rows on for every format; at `NARROW_FROM` (eight rows in one eight-lane group: a
/// batch-8 decode step) for all but Q2_K — 1.1-1.6x at 8 rows on Q4_0, Q4_1, Q8_0, Q4_K and
/// Q6_K (kernels/benches/many_rows.rs, benchmarks/prefill-int8-cpu-2core.md); Q2_K's measured
/// even with the few-row kernel at 8 (benchmarks/matvec-cpu-2core.md) and keeps it.
pub(super) fn lanes_pay(form: Form, m: usize) -> bool {
    m >= LANES_FROM || (m >= NARROW_FROM && form != Form::Q2k)
}

/// The instructions `dot_lanes` runs with on this CPU: AVX-512 F/BW/VL with VNNI where it has
/// them (and `isa::avx512()` allows them), else AVX2 with FMA and F16C (which the weight
/// unpacking uses either way); none without AVX2. Detected once.
pub fn isa() -> Option<Isa> {
    static DETECTED: std::sync::OnceLock<Option<Isa>> = std::sync::OnceLock::new();
    *DETECTED.get_or_init(|| {
        if !super::int8::simd() {
            None
        } else if super::isa::avx512()
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512vnni")
        {
            Some(Isa::Vnni)
        } else {
            Some(Isa::Avx2)
        }
    })
}

/// Whether this CPU runs `dot_lanes`.
pub fn available() -> bool {
    isa().is_some()
}

/// `out[j·m + a]` = weight row `j` of `w` (rows of `rb` bytes of `dtype`) · activation row `a` of
/// `lanes` (m rows), with the bits `int8::dot_rows` gives for any subset of those rows.
///
/// # Safety
/// The CPU must run `lanes`'s `Isa` (`available()` where it was built by `Q8Lanes::new`); `w`
/// must hold `out.len() / m` rows of `rb` bytes, whole blocks of `dtype` (one `int8::supports`)
/// spanning `lanes.units` units of 32 values.
pub unsafe fn dot_lanes(dtype: DType, w: &[u8], rb: usize, lanes: &Q8Lanes, out: &mut [f32]) {
    match lanes.isa {
        Isa::Vnni if lanes.amx && form(dtype) == Form::Plain => {
            super::int8_amx::dot(dtype, w, rb, lanes, out)
        }
        Isa::Vnni => dot_vnni(dtype, w, rb, lanes, out),
        Isa::Avx2 => dot_avx2(dtype, w, rb, lanes, out),
    }
}

/// `dot_lanes` with AVX-512 VNNI: sixteen-lane groups in 512-bit registers, eight in 256.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_vnni(dtype: DType, w: &[u8], rb: usize, lanes: &Q8Lanes, out: &mut [f32]) {
    steps::<Z16, Y8>(dtype, w, rb, lanes, out)
}

/// `dot_lanes` with AVX2 alone: eight-lane groups.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(dtype: DType, w: &[u8], rb: usize, lanes: &Q8Lanes, out: &mut [f32]) {
    steps::<A8, A8>(dtype, w, rb, lanes, out)
}

/// The body of `dot_lanes`: `W` for sixteen-lane groups, `H` for eight.
#[inline(always)]
unsafe fn steps<W: Reg, H: Reg>(
    dtype: DType,
    w: &[u8],
    rb: usize,
    lanes: &Q8Lanes,
    out: &mut [f32],
) {
    let m = lanes.rows();
    let u = lanes.units;
    let f = form(dtype);
    let signed = signed(dtype);
    // A tile of weight rows unpacked at a time, then each group of activation rows against every
    // row of the tile: a group (units × 640 bytes) stays in cache for the tile's rows instead of
    // all groups streaming past each weight row (at 512 rows of 4096 values they are 2.6 MB).
    let mut units = vec![Unit::default(); u * TILE];
    // The formats summed a unit whole take unit i of every row of the tile side by side (a tile
    // reads them from one address a unit), the others a row's units in a run.
    let whole_units = f != Form::Q2k;
    for (t0, o) in out.chunks_mut(m * TILE).enumerate() {
        let rows = o.len() / m;
        for r in 0..rows {
            let at = if whole_units {
                Out::new(&mut units, r, TILE, u)
            } else {
                Out::new(&mut units, r * u, 1, u)
            };
            unpack(dtype, w.as_ptr().add((t0 * TILE + r) * rb), at, u, W::BIASED);
        }
        let mut a0 = 0;
        for g in &lanes.groups {
            if whole_units {
                let mut sums = [[0f32; LANES]; TILE];
                let (us, s) = (&units[..], &mut sums[..rows]);
                match (f, signed) {
                    (Form::Plain, false) if nibbles(dtype) => {
                        whole::<1, false, true, TILE, W, H>(us, g, s)
                    }
                    (Form::Plain, false) => whole::<1, false, false, TILE, W, H>(us, g, s),
                    (Form::Plain, true) => whole::<1, true, false, TILE, W, H>(us, g, s),
                    _ => whole::<2, true, false, HALF_TILE, W, H>(us, g, s),
                }
                for (r, s) in sums.iter().take(rows).enumerate() {
                    o[r * m + a0..r * m + a0 + g.rows].copy_from_slice(&s[..g.rows]);
                }
                a0 += g.rows;
                continue;
            }
            for (r, us) in units.chunks_exact(u).take(rows).enumerate() {
                let sums = if g.width == LANES { q2k::<W>(us, g) } else { q2k::<H>(us, g) };
                o[r * m + a0..r * m + a0 + g.rows].copy_from_slice(&sums[..g.rows]);
            }
            a0 += g.rows;
        }
    }
}

/// The tile's weight rows (`out.len()` of them; unit i of row r at `units[i·TILE + r]`) against one group, for the formats
/// whose kernels sum a unit's products whole: `R` rows at once where they divide the tile, else
/// one by one; in `W`'s registers for a sixteen-lane group, `H`'s for eight.
#[inline(always)]
unsafe fn whole<const FORM: u8, const SIGNED: bool, const CHAIN16: bool, const R: usize, W, H>(
    units: &[Unit],
    g: &Group,
    out: &mut [[f32; LANES]],
) where
    W: Reg,
    H: Reg,
{
    let (rows, wide) = (out.len(), g.width == LANES);
    let n = units.len() / TILE;
    let at_once = if rows.is_multiple_of(R) { R } else { 1 };
    for r0 in (0..rows).step_by(at_once) {
        let (us, s) = (&units[r0..], &mut out[r0..r0 + at_once]);
        match (at_once > 1, wide) {
            (true, true) => tile::<FORM, SIGNED, CHAIN16, R, W>(us, n, g, s),
            (true, false) => tile::<FORM, SIGNED, CHAIN16, R, H>(us, n, g, s),
            (false, true) => tile::<FORM, SIGNED, CHAIN16, 1, W>(us, n, g, s),
            (false, false) => tile::<FORM, SIGNED, CHAIN16, 1, H>(us, n, g, s),
        }
    }
}

/// `R` weight rows (unit i of row r at `units[i·TILE + r]`, `n` units a row) against one group, for the formats whose
/// kernels sum a unit's products whole (`FORM` 1: `Form::Plain`, 2: Q3_K/Q6_K — `int8_batch::subs8`,
/// `int8_batch::units`):
/// each unit's `vpdpbusd`s chained into one integer per row (two, one per 16-value scale, for
/// `FORM` 2), one activation load serving the `R` rows; the unit's sum converted once and added
/// into lane `unit mod 8` of the row's accumulators, which those kernels' sub-block lanes are.
/// `CHAIN16`: a unit's products may be added in 16 bits (4-bit values: `nibbles`).
// Rows index the chains, the accumulators and the units alike: a loop over `r` reads clearest.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<const FORM: u8, const SIGNED: bool, const CHAIN16: bool, const R: usize, V: Reg>(
    units: &[Unit],
    n: usize,
    g: &Group,
    out: &mut [[f32; LANES]],
) {
    let zero = V::set_f(0.0);
    let mut lane = [[zero; 8]; R];
    let (xb, dxb, dsb) =
        (g.x.as_ptr() as *const u8, g.dx.as_ptr() as *const f32, g.ds.as_ptr() as *const f32);
    let up = units.as_ptr();
    for i in 0..n {
        let x = xb.add(4 * V::N * 8 * i);
        let mut h = [[V::set_i(0); R]; 2];
        for r in 0..R {
            let b = if V::BIASED { (*up.add(i * TILE + r)).bsum } else { [0; 2] };
            if FORM == 1 {
                h[0][r] = V::set_i(b[0] + b[1]);
            } else {
                (h[0][r], h[1][r]) = (V::set_i(b[0]), V::set_i(b[1]));
            }
        }
        let wt = |r: usize, t: usize| {
            let wp = (*up.add(i * TILE + r)).v.as_ptr() as *const i32;
            V::set_i(std::ptr::read_unaligned(wp.add(t)))
        };
        // |w| for signed weights against signed activations (unused otherwise).
        let mt = |r: usize, t: usize| match SIGNED && !V::BIASED {
            true => V::set_i((*up.add(i * TILE + r)).mag(t)),
            false => wt(r, t),
        };
        if !V::BIASED && (FORM == 2 || CHAIN16) {
            // Signed activations: the 16-bit pair sums of a chain added up before one widening
            // (Q4_K: 8·2·15·127, Q3_K/Q6_K: 4·2·32·127 per half, both below 2^15).
            let mut p = [[V::set_i(0); R]; 2];
            for t in 0..8 {
                let xv = V::load_i(x.add(4 * V::N * t));
                let half = if FORM == 1 { 0 } else { t / 4 };
                for r in 0..R {
                    p[half][r] = V::add16(p[half][r], V::pairs::<SIGNED>(xv, wt(r, t), mt(r, t)));
                }
            }
            for r in 0..R {
                h[0][r] = V::widen(p[0][r]);
                if FORM == 2 {
                    h[1][r] = V::widen(p[1][r]);
                }
            }
        } else {
            for t in 0..8 {
                let xv = V::load_i(x.add(4 * V::N * t));
                let half = if FORM == 1 { 0 } else { t / 4 };
                for r in 0..R {
                    h[half][r] = V::dp::<SIGNED>(h[half][r], xv, wt(r, t), mt(r, t));
                }
            }
        }
        let dx = V::load_f(dxb.add(V::N * i));
        for r in 0..R {
            let u = &*up.add(i * TILE + r);
            let s = if FORM == 1 {
                h[0][r]
            } else {
                V::add_i(V::mullo(h[0][r], V::set_i(u.sa)), V::mullo(h[1][r], V::set_i(u.sb)))
            };
            let l = &mut lane[r][i % 8];
            *l = V::fmadd(V::mul(V::set_f(u.d), dx), V::cvt(s), *l);
        }
    }
    for r in 0..R {
        let acc = &mut lane[r];
        if FORM == 1 {
            let mut off = [zero; 8];
            for i in 0..n {
                let c = V::set_f((*up.add(i * TILE + r)).c);
                off[i % 8] = V::fmadd(c, V::load_f(dsb.add(V::N * i)), off[i % 8]);
            }
            for t in 0..8 {
                acc[t] = V::add(acc[t], off[t]);
            }
        }
        V::store_f(out[r].as_mut_ptr(), lanes_sum::<V>(acc));
    }
}

/// The eight accumulators of each output lane summed in `int8_batch::hsum`'s order:
/// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
#[inline(always)]
pub(super) unsafe fn lanes_sum<V: Reg>(acc: &[V::F; 8]) -> V::F {
    let h = |a: usize, b: usize| V::add(acc[a], acc[b]);
    V::add(V::add(h(0, 4), h(2, 6)), V::add(h(1, 5), h(3, 7)))
}

/// One Q2_K weight row's units against one group of rows, in registers of `V`'s width: per four
/// values (lane t of the few-row kernel) the integer sums times the 16 values' scale and min,
/// dx multiplied last.
// t indexes the activations, the weights and the accumulators alike.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn q2k<V: Reg>(units: &[Unit], g: &Group) -> [f32; LANES] {
    let zero = V::set_f(0.0);
    let mut acc = [zero; 8];
    let ones = V::set_i(0x0101_0101);
    let (xb, dxb) = (g.x.as_ptr() as *const u8, g.dx.as_ptr() as *const f32);
    for (i, u) in units.iter().enumerate() {
        let x = xb.add(4 * V::N * 8 * i);
        let dx = V::load_f(dxb.add(V::N * i));
        let vp = u.v.as_ptr() as *const i32;
        let (d, mdmin) = (V::set_f(u.d), V::set_f(u.c));
        for t in 0..8 {
            let xv = V::load_i(x.add(4 * V::N * t));
            let wt = V::set_i(std::ptr::read_unaligned(vp.add(t)));
            let p = V::dp::<false>(V::set_i(if V::BIASED { u.bias[t] } else { 0 }), xv, wt, wt);
            let (sc, mn) = if t < 4 { (u.sa, u.ma) } else { (u.sb, u.mb) };
            // Σ of the four activations (stored as q + 128: Σ (q + 128) − 512).
            let sx = V::dp::<false>(V::set_i(if V::BIASED { -512 } else { 0 }), xv, ones, ones);
            let iq = V::mullo(p, V::set_i(sc));
            let im = V::mullo(sx, V::set_i(mn));
            let tt = V::fmadd(mdmin, V::cvt(im), V::mul(d, V::cvt(iq)));
            acc[t] = V::fmadd(dx, tt, acc[t]);
        }
    }
    let mut r = [0f32; LANES];
    V::store_f(r.as_mut_ptr(), lanes_sum::<V>(&acc));
    r
}

/// Whether `dtype`'s unpacked values are 4-bit (below 16): eight of their pair sums fit 16 bits
/// (8·2·15·127), so AVX2 adds a unit's before one widening (`tile`'s `CHAIN16`).
fn nibbles(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q4K | DType::Int4G128)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::int8::{dot, dot_rows, dot_scalar, quantize_row, supports, Acts};
    use crate::quant::{dequant_row, dot as f32_dot};

    /// Every format with an 8-bit dot, with a width of an odd number of its blocks.
    const TYPES: [(DType, usize); 13] = [
        (DType::Q8_0, 32 * 7),
        (DType::Q4_0, 32 * 9),
        (DType::Q4_1, 32 * 5),
        (DType::Q5_0, 32 * 11),
        (DType::Q5_1, 32 * 3),
        (DType::Mxfp4, 32 * 7),
        (DType::Int8B128, 128 * 3),
        (DType::Int4G128, 128 * 5),
        (DType::Q2K, 256 * 3),
        (DType::Q3K, 256),
        (DType::Q4K, 256 * 3),
        (DType::Q5K, 256 * 5),
        (DType::Q6K, 256 * 3),
    ];

    /// Eight rows take the lanes where they measured faster; nine and more always, fewer never.
    #[test]
    fn lanes_pay_from_nine_rows_and_at_eight_for_the_formats_measured_faster() {
        for f in [Form::Plain, Form::Scaled16, Form::Q2k] {
            assert!(!lanes_pay(f, 7) && lanes_pay(f, 9) && lanes_pay(f, 300), "{f:?}");
        }
        assert!(lanes_pay(Form::Plain, 8) && lanes_pay(Form::Scaled16, 8));
        assert!(!lanes_pay(Form::Q2k, 8));
    }

    /// Rows of activations with different magnitudes and signs (row a scaled by a − 4.5).
    fn activations(m: usize, k: usize) -> Vec<f32> {
        (0..m * k)
            .map(|i| {
                let (a, t) = (i / k, i % k);
                ((t * 37 + a * 11) % 101) as f32 * 0.021 * (a % 9) as f32 - 0.5 * (a % 5) as f32
            })
            .collect()
    }

    /// For 1 to 300 rows (groups of eight lanes and of sixteen, full and not) and 11 weight rows of
    /// each format, laid out for each instruction set this CPU runs (AVX2, and AVX-512 VNNI where it
    /// has it): every output of the many-row kernel has the bits the one-row kernel gives that row
    /// alone (a sequence's result does not depend on what its step holds, nor on the CPU's
    /// instructions), matches the scalar reference to rounding and the f32 dot of the dequantized
    /// weights within 1% of Σ|w·x|.
    #[test]
    #[cfg_attr(not(have_avx2), ignore = "this CPU lacks AVX2, FMA or F16C")]
    fn many_rows_give_each_rows_bits_alone_and_match_the_references() {
        let isas = match isa() {
            Some(Isa::Vnni) => vec![Isa::Vnni, Isa::Avx2],
            Some(Isa::Avx2) => vec![Isa::Avx2],
            None => {
                panic!("the build saw AVX2, FMA and F16C in /proc/cpuinfo, the CPU denies them")
            }
        };
        let vnni = cfg!(have_avx512_vnni) && crate::cpu::isa::avx512();
        assert_eq!(vnni, isas.len() == 2, "AVX-512 VNNI: build and CPU agree (and no cap)");
        for (dtype, k) in TYPES {
            assert!(supports(dtype));
            let n = 11; // a whole tile of weight rows and a part of one
            let w = layerstream_types::random::Rng::new(21).tensor(dtype, &[n, k]).unwrap();
            let rb = w.len() / n;
            let mut deq = vec![0f32; n * k];
            for (o, r) in deq.chunks_exact_mut(k).zip(w.chunks_exact(rb)) {
                dequant_row(dtype, r, o);
            }
            for (m, &isa) in
                [1, 3, 8, 9, 16, 20, 24, 63, 64, 300].into_iter().zip(isas.iter().cycle())
            {
                let x = activations(m, k);
                let rows: Vec<_> = x.chunks_exact(k).map(quantize_row).collect();
                let laid = crate::cpu::int8::quantize(&x, k, m);
                assert_eq!(matches!(laid, Acts::Lanes(_)), m >= NARROW_FROM, "{m} rows");
                let lanes = Q8Lanes::for_isa(rows.clone(), k / 32, isa);
                let mut got = vec![0f32; n * m];
                // SAFETY: this CPU runs `isa`; w holds n rows of rb bytes spanning k values.
                unsafe { dot_lanes(dtype, &w, rb, &lanes, &mut got) };
                if crate::cpu::int8_amx::available() {
                    // AMX tiles (the formats summed a unit whole; the others the VNNI kernel):
                    // the same bits at every row count.
                    let tiles = Q8Lanes::for_amx(rows, k / 32);
                    let mut on_tiles = vec![0f32; n * m];
                    // SAFETY: as above; AMX is available.
                    unsafe { dot_lanes(dtype, &w, rb, &tiles, &mut on_tiles) };
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&on_tiles), bits(&got), "{dtype} m={m} on AMX tiles");
                }
                // The step as the model runs it: lanes or the few-row kernel, the same bits.
                let mut via = vec![0f32; n * m];
                dot(dtype, &w, rb, &laid, &mut via);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    via.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{dtype} m={m} {isa:?} through int8::dot"
                );
                for a in 0..m {
                    let row = &x[a * k..(a + 1) * k];
                    let xq = quantize_row(row);
                    let mut alone = vec![0f32; n];
                    dot_rows(dtype, &w, rb, std::slice::from_ref(&xq), &mut alone);
                    for j in 0..n {
                        let g = got[j * m + a];
                        assert_eq!(
                            g.to_bits(),
                            alone[j].to_bits(),
                            "{dtype} m={m} row {a} col {j}"
                        );
                        let reference = dot_scalar(dtype, &w[j * rb..(j + 1) * rb], &xq);
                        let wf = &deq[j * k..(j + 1) * k];
                        let scale: f32 = wf.iter().zip(row).map(|(p, q)| (p * q).abs()).sum();
                        let exact = f32_dot(wf, row);
                        // The reference adds the blocks in another order: rounding of Σ|w·x|.
                        assert!(
                            (g - reference).abs() <= 1e-5 * scale.max(1.0),
                            "{dtype} m={m}: {g} vs scalar {reference}"
                        );
                        assert!(
                            (g - exact).abs() <= 0.01 * scale.max(1e-3),
                            "{dtype}: {g} vs f32 {exact}"
                        );
                    }
                }
            }
        }
    }
}
