//! The many-row 8-bit path on AMX tiles (Intel's Advanced Matrix Extensions, Sapphire Rapids and
//! later), for the formats whose units are summed whole (`Form::Plain`: Q8_0, Q4_0/1, Q5_0/1,
//! MXFP4, int8_b128, int4_g128, Q4_K, Q5_K): one `tdpbusd` multiplies a unit (32 values) of
//! sixteen activation rows with the same unit of sixteen weight rows — 8,192 multiply-adds, where
//! a `vpdpbusd` does 64 — giving each pair's exact integer sum of its 32 products.
//!
//! Those integers are the ones `int8_lanes::tile` chains with `vpdpbusd` (activations as q + 128,
//! −128·Σw added: exact integer arithmetic in any order), and everything after them is that
//! kernel's f32 arithmetic in its order — (d·dx)·P fused into lane `unit mod 8`, the offsets
//! c·(dx·Σq) likewise, the lanes summed in `int8_batch::hsum`'s order — only with the weight rows
//! across a register instead of the activation rows. So an output has the same bits on AMX, on
//! AVX-512 VNNI and on AVX2, one row or three hundred (the kernel tests compare them bit for bit).
//!
//! AMX state is asked of the kernel once per process (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); where it
//! refuses, or `LAYERSTREAM_CPU_ISA` caps the instruction sets below it, the VNNI path runs.

use super::int8_lanes::{lanes_sum, Group, Q8Lanes, LANES};
use super::int8_units::{unpack, Out, Unit};
use layerstream_types::DType;
use std::arch::asm;
use std::arch::x86_64::*;

/// Weight rows a tile takes (the columns of a 16×16 result of i32).
const COLS: usize = 16;

/// Steps of at least this many activation rows take the tiles: a step's weights are repacked for
/// them once per step, which fewer rows do not repay. Measured end to end on an 8B-shaped Q4_K
/// prefill (2 vCPUs of a Sapphire Rapids-class VM, tok/s, tiles / VNNI): 64 rows 147 / 186,
/// 128 rows 184 / 208, 256 rows 212 / 210, 384 rows 223 / 210, 512 rows 221 / 187.
pub const AMX_FROM: usize = 384;

/// Whether this CPU and kernel run AMX's 8-bit tiles here, and `LAYERSTREAM_CPU_ISA` allows them
/// (asked once; the first call requests the tile state for the process).
pub fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        if super::isa::cap() != Ok(super::isa::Cap::Native)
            || super::int8_lanes::isa() != Some(super::int8_lanes::Isa::Vnni)
        {
            return false;
        }
        // Leaf 7 exists on every CPU with AVX-512 (checked above).
        let edx = __cpuid_count(7, 0).edx;
        let (tile, int8) = (edx >> 24 & 1 == 1, edx >> 25 & 1 == 1);
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with this request only asks for permission to use the tile state;
        // it fails (nonzero) where the kernel or CPU lacks it.
        tile && int8
            && unsafe {
                libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
            } == 0
            && probe_in_child()
    })
}

/// Runs `probe` in a child process: true where it exited with the right sums. A hypervisor that
/// reports AMX and grants its state yet faults on the tiles (llama.cpp's AMX build crashed on one
/// such VM here) kills the child, not the worker, and the VNNI path runs.
fn probe_in_child() -> bool {
    // SAFETY: the child runs `probe` alone — no allocation, no lock, no other thread's state —
    // and leaves with `_exit`; the parent waits for that child only.
    unsafe {
        match libc::fork() {
            0 => libc::_exit(if probe() { 0 } else { 1 }),
            -1 => false,
            pid => {
                let mut status = 0;
                libc::waitpid(pid, &mut status, 0) == pid
                    && libc::WIFEXITED(status)
                    && libc::WEXITSTATUS(status) == 0
            }
        }
    }
}

/// One unit of 16 × 16 rows on the tiles, against the same sums added up one by one.
///
/// # Safety
/// The tile state is granted (`arch_prctl`) on a CPU reporting AMX-TILE and AMX-INT8.
unsafe fn probe() -> bool {
    let mut a = [0u8; 16 * 32];
    let mut b = BTile([0; 512]);
    let bias = Row16([-7i32; 16]);
    for (i, v) in a.iter_mut().enumerate() {
        *v = (i * 7 % 251) as u8;
    }
    for (i, v) in b.0.iter_mut().enumerate() {
        *v = (i * 13 % 200) as u8;
    }
    let mut c = [Row16::<i32>::default(); 16];
    // SAFETY: the caller's contract; C reads 64 bytes (one row, stride 0), A 16 rows of 32 bytes
    // 32 apart (`a`), B 8 rows of 64 (`b`), and the product's 16 rows of 64 bytes go into `c`.
    configure();
    product(false, (bias.0.as_ptr(), a.as_ptr(), 32, b.0.as_ptr()), c.as_mut_ptr());
    release();
    (0..16).all(|m| {
        (0..16).all(|n| {
            let sum: i32 = (0..32)
                .map(|k| a[32 * m + k] as i32 * b.0[64 * (k / 4) + 4 * n + k % 4] as i8 as i32)
                .sum();
            c[m].0[n] == sum - 7
        })
    })
}

/// Palette 1: tiles 0 (C: 16 rows of 16 i32), 1 (A: 16 activation rows of one unit's 32 bytes),
/// 2 (B: the unit's 8 groups of four values of 16 weight rows, 64 bytes a row); 3, 4 and 5 the
/// same for the next unit (two units in flight: one's product stored while the other's is read).
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: Config = {
    let mut colsb = [0u16; 16];
    let mut rows = [0u8; 16];
    (colsb[0], rows[0]) = (64, 16);
    (colsb[1], rows[1]) = (32, 16);
    (colsb[2], rows[2]) = (64, 8);
    (colsb[3], rows[3]) = (64, 16);
    (colsb[4], rows[4]) = (32, 16);
    (colsb[5], rows[5]) = (64, 8);
    Config { palette: 1, start_row: 0, reserved: [0; 14], colsb, rows }
};

/// A tile's weights for one unit: for t in 0..8, the values 4t..4t+4 of each of the 16 rows.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct BTile([u8; 512]);

/// Sixteen f32 or i32, one a weight row.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Row16<T: Copy + Default>([T; 16]);

/// `int8_lanes::dot_lanes` on AMX tiles for a `Form::Plain` dtype: `out[j·m + a]`.
///
/// # Safety
/// `available()`; `lanes` built with its AMX rows (`Q8Lanes::amx`); `w` holds `out.len() / m`
/// rows of `rb` bytes of `dtype`, whole blocks spanning `lanes.units()` units.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot(dtype: DType, w: &[u8], rb: usize, lanes: &Q8Lanes, out: &mut [f32]) {
    let (m, u) = (lanes.rows(), lanes.units());
    let mut units = vec![Unit::default(); u * COLS];
    let mut b = vec![BTile([0; 512]); u];
    let (mut d, mut c) = (vec![Row16::<f32>::default(); u], vec![Row16::<f32>::default(); u]);
    let mut bias = vec![Row16::<i32>::default(); u];
    // SAFETY: `available()` (the caller's contract): the CPU has AMX and the process may use its
    // state. Released below.
    configure();
    for (t0, o) in out.chunks_mut(m * COLS).enumerate() {
        let cols = o.len() / m;
        for r in 0..cols {
            unpack(
                dtype,
                w.as_ptr().add((t0 * COLS + r) * rb),
                Out::new(&mut units, r, COLS, u),
                u,
                true,
            );
        }
        // Rows past `cols` keep the last tile's units: their outputs are not written.
        for i in 0..u {
            for r in 0..COLS {
                let un = &units[i * COLS + r];
                (d[i].0[r], c[i].0[r]) = (un.d, un.c);
                bias[i].0[r] = un.bsum[0] + un.bsum[1];
                for t in 0..8 {
                    // SAFETY: i8 and u8 have one size and alignment; the bytes are copied as is.
                    b[i].0[64 * t + 4 * r..64 * t + 4 * r + 4].copy_from_slice(
                        std::mem::transmute::<&[i8], &[u8]>(&un.v[4 * t..4 * t + 4]),
                    );
                }
            }
        }
        let mut a0 = 0;
        for g in lanes.groups() {
            let mut sums = [Row16::<f32>::default(); LANES];
            group(g, u, (&b, &d, &c, &bias), &mut sums);
            for r in 0..cols {
                for a in 0..g.rows {
                    o[r * m + a0 + a] = sums[a].0[r];
                }
            }
            a0 += g.rows;
        }
    }
    // SAFETY: ends this thread's use of the tiles configured above (nothing reads them after).
    release();
}

/// Configures this thread's tiles as `CONFIG`.
///
/// # Safety
/// The process may use the tile state (`arch_prctl`) on a CPU with AMX-TILE.
#[inline(always)]
unsafe fn configure() {
    // SAFETY: the caller's contract; CONFIG is a valid palette-1 configuration of 64 bytes.
    asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
}

/// Ends this thread's use of the tiles (`configure`).
///
/// # Safety
/// As `configure`; nothing reads the tiles after.
#[inline(always)]
unsafe fn release() {
    // SAFETY: the caller's contract.
    asm!("tilerelease", options(nostack, nomem));
}

/// One unit's products on tiles 0-2 (`odd` false) or 3-5: C loaded from `c` (one row of 16 i32
/// read 16 times: stride 0), A 16 rows of 32 bytes `k` apart from `x`, B 8 rows of 64 bytes from
/// `b`, C += A·B (`tdpbusd`), C stored as 16 rows of 64 bytes at `p`.
///
/// # Safety
/// The tiles are configured (`configure`); each pointer spans what it is read or written as.
#[inline(always)]
unsafe fn product(
    odd: bool,
    (c, x, k, b): (*const i32, *const u8, usize, *const u8),
    p: *mut Row16<i32>,
) {
    macro_rules! on_tiles {
        ($c:literal, $a:literal, $b:literal) => {
            // SAFETY: the caller's contract.
            asm!(
                concat!("tileloadd ", $c, ", [{c} + {zero}*1]"),
                concat!("tileloadd ", $a, ", [{x} + {k}*1]"),
                concat!("tileloadd ", $b, ", [{b} + {s64}*1]"),
                concat!("tdpbusd ", $c, ", ", $a, ", ", $b),
                concat!("tilestored [{p} + {s64}*1], ", $c),
                c = in(reg) c, zero = in(reg) 0usize, x = in(reg) x, k = in(reg) k,
                b = in(reg) b, s64 = in(reg) 64usize, p = in(reg) p,
                options(nostack),
            )
        };
    }
    if odd {
        on_tiles!("tmm3", "tmm4", "tmm5");
    } else {
        on_tiles!("tmm0", "tmm1", "tmm2");
    }
}

/// Bytes from one activation row to the next in `Group::xa`: the row's `32·units` and a cache
/// line more, so that sixteen rows read side by side (4 KiB apart at 4096 values) do not all fall
/// in one set of the first-level cache.
pub(super) fn row_stride(units: usize) -> usize {
    32 * units + 64
}

/// One group of activation rows (`g.rows` of them, at most 16) against a tile's 16 weight rows:
/// `sums[a].0[r]` = row r · activation row a.
///
/// # Safety
/// Called by `dot` with the tiles configured; `g.xa` holds 16 rows of `row_stride(u)` bytes and
/// `b`, `d`, `c`, `bias` one entry per unit of the `u`.
#[allow(clippy::type_complexity)]
#[inline(always)]
unsafe fn group(
    g: &Group,
    u: usize,
    (b, d, c, bias): (&[BTile], &[Row16<f32>], &[Row16<f32>], &[Row16<i32>]),
    sums: &mut [Row16<f32>; LANES],
) {
    let stride = row_stride(u);
    let (xa, dx, ds, width) =
        (g.xa.as_ptr(), g.dx.as_ptr() as *const f32, g.ds.as_ptr() as *const f32, g.width);
    let mut acc = [[_mm512_setzero_ps(); 8]; LANES];
    let mut p = [[Row16::<i32>::default(); LANES]; 2];
    // Unit i's product into p[i % 2] on tiles 0-2 (even) or 3-5 (odd), then unit i − 1's
    // epilogue: the store has a unit's worth of work to land before its rows are read. (Eight
    // units' tiles before their epilogue, the accumulators kept in registers across them, ran
    // 10% slower: 128 row stores in flight fill the store buffer.)
    let tiles = |i: usize, p: *mut Row16<i32>| {
        // C = each weight row's −128·Σw, plus Σ (q + 128)·w.
        // SAFETY: the tiles were configured by `dot`; bias[i] is one row of 16 i32, A 16 rows of
        // 32 bytes `stride` apart from unit i of the group's first row (16 rows of `stride` bytes
        // in `xa`, unit i's 32 bytes inside each), b[i] 8 rows of 64 bytes, `p` 16 rows of 16 i32.
        let at = (bias[i].0.as_ptr(), xa.add(32 * i), stride, b[i].0.as_ptr());
        product(!i.is_multiple_of(2), at, p)
    };
    for i in 0..=u {
        if i < u {
            tiles(i, p[i % 2].as_mut_ptr());
        }
        if i == 0 {
            continue;
        }
        let j = i - 1;
        let dw = _mm512_load_ps(d[j].0.as_ptr());
        for a in 0..g.rows {
            let s = _mm512_cvtepi32_ps(_mm512_load_si512(p[j % 2][a].0.as_ptr() as *const _));
            let dd = _mm512_mul_ps(dw, _mm512_set1_ps(*dx.add(width * j + a)));
            let l = &mut acc[a][j % 8];
            *l = _mm512_fmadd_ps(dd, s, *l);
        }
    }
    for a in 0..g.rows {
        let mut off = [_mm512_setzero_ps(); 8];
        for i in 0..u {
            let cv = _mm512_load_ps(c[i].0.as_ptr());
            off[i % 8] = _mm512_fmadd_ps(cv, _mm512_set1_ps(*ds.add(width * i + a)), off[i % 8]);
        }
        let l = &mut acc[a];
        for t in 0..8 {
            l[t] = _mm512_add_ps(l[t], off[t]);
        }
        _mm512_store_ps(sums[a].0.as_mut_ptr(), lanes_sum::<super::int8_regs::Z16>(l));
    }
}
