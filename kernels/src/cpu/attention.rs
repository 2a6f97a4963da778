//! CPU grouped-query attention over a paged KV pool: a layer's blocks shared by every sequence,
//! each sequence's positions found through its block table; causal prefill, one-token decode and
//! token trees alike.

use super::{attend, softmax8};
use crate::backend::AttnShape;
use crate::kv::{hadamard, rotation, store_row, KvLayout, KvSeq};
use crate::quant::dequant_row;
use layerstream_types::DType;
use rayon::prelude::*;

/// One layer's KV pool: keys and values of `layout.blocks` blocks, one stored row per position
/// (`layout.row_stride` bytes). Memory is taken as blocks are first written (up to the pool's
/// size), so a large pool costs only what its sequences use.
#[derive(Debug, Clone)]
pub struct CpuKv {
    pub layout: KvLayout,
    kv_dim: usize,
    /// 4-byte words so that f32 rows are read in place.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Keys only: the values are the keys (`AttnShape::shared_kv`); `v` stays empty.
    keys_only: bool,
}

impl CpuKv {
    /// An empty pool for rows of `kv_dim` values (keys only: see `AttnShape::shared_kv`).
    pub fn new(layout: KvLayout, kv_dim: usize, keys_only: bool) -> CpuKv {
        CpuKv { layout, kv_dim, k: Vec::new(), v: Vec::new(), keys_only }
    }

    /// The stored buffers: keys, then values unless the values are the keys.
    fn bufs(&self) -> usize {
        if self.keys_only {
            1
        } else {
            2
        }
    }

    fn words(&self) -> usize {
        self.layout.row_stride(self.kv_dim) / 4
    }

    /// Bytes the pool holds now.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 4
    }

    /// Block `b`'s keys then values (keys only when they are shared) as bytes (zeros where nothing
    /// was written yet).
    pub fn read_block(&self, b: usize) -> Vec<u8> {
        let n = self.layout.block * self.words();
        let mut out = Vec::with_capacity(8 * n);
        for buf in [&self.k, &self.v].into_iter().take(self.bufs()) {
            let words = buf.get(b * n..(b + 1) * n).unwrap_or(&[]);
            out.extend(words.iter().flat_map(|x| x.to_le_bytes()));
            out.resize(out.len() + 4 * (n - words.len()), 0);
        }
        out
    }

    /// Writes `read_block`'s bytes into block `b`; an error names a size that does not fit.
    pub fn write_block(&mut self, b: usize, bytes: &[u8]) -> Result<(), String> {
        let n = self.layout.block * self.words();
        let size = 4 * n * self.bufs();
        if bytes.len() != size || b >= self.layout.blocks {
            return Err(format!(
                "{} bytes for block {b} of a pool of {} blocks of {size} bytes",
                bytes.len(),
                self.layout.blocks,
            ));
        }
        self.reach(b);
        let (k, v) = bytes.split_at(4 * n);
        let bufs = self.bufs();
        for (buf, src) in [(&mut self.k, k), (&mut self.v, v)].into_iter().take(bufs) {
            for (w, c) in buf[b * n..(b + 1) * n].iter_mut().zip(src.chunks_exact(4)) {
                *w = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Ok(())
    }

    /// Grows the storage to hold block `b`.
    fn reach(&mut self, b: usize) {
        let n = (b + 1) * self.layout.block * self.words();
        if self.k.len() < n {
            self.k.resize(n, 0.0);
            if !self.keys_only {
                self.v.resize(n, 0.0);
            }
        }
    }

    /// Position `slot`'s stored row of keys (or values) as bytes.
    fn row_mut(buf: &mut [f32], slot: usize, words: usize) -> &mut [u8] {
        let w = &mut buf[slot * words..(slot + 1) * words];
        // SAFETY: any initialised f32 storage may be viewed as bytes (alignment 1, same length × 4).
        unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u8>(), w.len() * 4) }
    }

    fn row(buf: &[f32], slot: usize, words: usize) -> &[u8] {
        let w = &buf[slot * words..(slot + 1) * words];
        // SAFETY: as `row_mut`, read-only.
        unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), w.len() * 4) }
    }
}

/// Stores `m` new rows at positions `seq.start..` of the pool and attends `q` (`[m, q_dim]`)
/// causally over the sequence's positions (over the last `s.window` positions of each row's
/// context when a window is set), scores scaled by `s.scale`. With a token tree's ancestor masks
/// (`tree`, at most 64 rows, full-context layers only) row i attends to the positions before
/// `seq.tree_from` and to the tree rows — cached ones from `tree_from`, then the new — whose bit is
/// set in `tree[i]` instead. `sinks`: one logit per
/// head in each softmax's denominator. Quantized rows are dequantized here; f32 rows are read in
/// place. `seq` has been checked against the pool.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    m: usize,
    pool: &mut CpuKv,
    seq: KvSeq<'_>,
    s: AttnShape,
    mask: Mask<'_>,
) -> Vec<f32> {
    let kvd = s.n_kv_heads * s.head_dim;
    let (start, bs, words, dtype) = (seq.start, pool.layout.block, pool.words(), pool.layout.dtype);
    if m > 0 {
        let top = (start..start + m).map(|t| seq.slot(t, bs) / bs).max().unwrap_or(0);
        pool.reach(top);
    }
    // A quantized pool holds every head's keys and values rotated (see `kv::rotation`).
    let rot = rotation(dtype, s.head_dim);
    let rotated = |x: &[f32]| {
        let mut x = x.to_vec();
        hadamard(&mut x, rot);
        x
    };
    for i in 0..m {
        let slot = seq.slot(start + i, bs);
        let (ki, vi) = (&k[i * kvd..(i + 1) * kvd], &v[i * kvd..(i + 1) * kvd]);
        let rows = [(ki, &mut pool.k), (vi, &mut pool.v)];
        for (x, buf) in rows.into_iter().take(if s.shared_kv { 1 } else { 2 }) {
            if rot > 0 {
                store_row(dtype, &rotated(x), CpuKv::row_mut(buf, slot, words));
            } else {
                store_row(dtype, x, CpuKv::row_mut(buf, slot, words));
            }
        }
    }
    let end = start + m;
    // The earliest position any row sees.
    let lo = if s.window > 0 { (start + 1).saturating_sub(s.window) } else { 0 };
    // Shared keys and values (MLA): the values are read from the keys.
    let (pk, pv) = (&pool.k, if s.shared_kv { &pool.k } else { &pool.v });
    let from = (start, lo, seq.tree_from);
    let (hd, seen) = (s.head_dim, end - lo);
    // From `HEADS_APART_FROM` rows on, the positions the rows see are copied head by head (see
    // there); fewer rows read the pool's rows in place (f32) or one dequantized copy.
    let apart = m >= HEADS_APART_FROM;
    if dtype == DType::F32 && !apart {
        // Read in place: position t's row starts at word at[t − lo] of the pool.
        let at: Vec<usize> = (lo..end).map(|t| seq.slot(t, bs) * words).collect();
        return attend(q, m, from, s, mask, (pk, pv, &at, hd));
    }
    // Position i (t − lo) of the copy: kv head g's row at word g·head_stride + at[i].
    let (at, head_stride): (Vec<usize>, usize) = match apart {
        true => ((0..seen).map(|i| i * hd).collect(), seen * hd),
        false => ((0..seen).map(|i| i * kvd).collect(), hd),
    };
    // Dequantized (or, f32, copied) once, the positions the rows see.
    let gather = |buf: &[f32]| -> Vec<f32> {
        let (mut out, mut row) = (vec![0f32; seen * kvd], vec![0f32; kvd]);
        for (i, &o) in at.iter().enumerate() {
            let stored = CpuKv::row(buf, seq.slot(lo + i, bs), words);
            if !apart {
                dequant_row(dtype, stored, &mut out[o..o + kvd]);
                continue;
            }
            dequant_row(dtype, stored, &mut row);
            for (g, r) in row.chunks_exact(hd).enumerate() {
                out[g * head_stride + o..][..hd].copy_from_slice(r);
            }
        }
        out
    };
    // Shared keys and values (MLA): one gather serves both.
    let gk = gather(pk);
    let own_v = (!s.shared_kv).then(|| gather(pv));
    let gv = own_v.as_ref().unwrap_or(&gk);
    if rot == 0 {
        return attend(q, m, from, s, mask, (&gk, gv, &at, head_stride));
    }
    // Scores against rotated keys need the rotated query; the output comes back rotated.
    let mut out = attend(&rotated(q), m, from, s, mask, (&gk, gv, &at, head_stride));
    hadamard(&mut out, rot);
    out
}

/// Rows of a step from which attention reads the positions it sees from a copy laid out head by
/// head (each kv head's positions contiguous) rather than position by position: in the pool a
/// head's consecutive positions lie a whole row apart (4 KiB for 8 kv heads of 128), a new page
/// for every position a query reads — no prefetch across it, a TLB entry each — which cost an
/// 8B-shaped model's 512-token prefill 8% in attention. The copy is read by every row and every
/// query head of its group; a step of few rows reads in place. The values read are the same
/// either way, so the same bits.
const HEADS_APART_FROM: usize = 16;

/// A token tree's ancestor masks and the heads' sinks, if any.
pub type Mask<'a> = (Option<&'a [u64]>, Option<&'a [f32]>);

/// The attention itself over positions `lo..` whose kv rows (for kv head g) start at words
/// `g·head_stride + at[t − lo]` of the key and value buffers; a tree's mask bit j names position
/// `tree_from + j`.
fn attend(
    q: &[f32],
    m: usize,
    (start, lo, tree_from): (usize, usize, usize),
    s: AttnShape,
    (tree, sinks): Mask<'_>,
    (kbuf, vbuf, at, head_stride): (&[f32], &[f32], &[usize], usize),
) -> Vec<f32> {
    let (hd, qd) = (s.head_dim, s.n_heads * s.head_dim);
    let group = s.n_heads / s.n_kv_heads;
    let mut out = vec![0f32; m * qd];
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (row, h) = (idx / s.n_heads, idx % s.n_heads);
        let off = (h / group) * head_stride;
        let qv = &q[row * qd + h * hd..row * qd + (h + 1) * hd];
        let n_ctx = start + row + 1;
        let first = if s.window > 0 { n_ctx.saturating_sub(s.window) } else { 0 };
        // The positions this row sees: causal (a run of the table), or the cached ones and its
        // ancestors in a tree.
        let picked: Vec<usize>;
        let seen: &[usize] = match tree {
            None => &at[first - lo..n_ctx - lo],
            Some(a) => {
                let ancestors = (0..n_ctx - tree_from).filter(|&j| a[row] >> j & 1 == 1);
                picked = (first..tree_from)
                    .chain(ancestors.map(|j| tree_from + j))
                    .map(|t| at[t - lo])
                    .collect();
                &picked
            }
        };
        // The head's columns: every row read from `off` on.
        let (keys, values) = (
            attend::Rows { buf: &kbuf[off..], at: seen },
            attend::Rows { buf: &vbuf[off..], at: seen },
        );
        let n = seen.len();
        let mut scores = vec![0f32; softmax8::padded(n)];
        attend::scores(qv, keys, s.scale, &mut scores[..n]);
        softmax8::softmax(&mut scores, n, sinks.map(|sk| sk[h]));
        attend::weighted_sum(&scores[..n], values, o);
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gen(n: usize, mul: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * mul) % 17) as f32 * 0.1 - 0.8).collect()
    }

    fn pool(dtype: DType, block: usize, s: AttnShape) -> CpuKv {
        CpuKv::new(
            KvLayout::new(dtype, block, 16, s).unwrap(),
            s.n_kv_heads * s.head_dim,
            s.shared_kv,
        )
    }

    /// Feeds rows `range` of (q, k, v) at their positions.
    #[allow(clippy::too_many_arguments)]
    fn feed(
        p: &mut CpuKv,
        table: &[u32],
        (q, k, v): (&[f32], &[f32], &[f32]),
        range: std::ops::Range<usize>,
        s: AttnShape,
        tree: Option<&[u64]>,
    ) -> Vec<f32> {
        let (qd, kvd) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
        let (a, b) = (range.start, range.end);
        let seq = KvSeq::new(table, a);
        attention(
            &q[a * qd..b * qd],
            &k[a * kvd..b * kvd],
            &v[a * kvd..b * kvd],
            b - a,
            p,
            seq,
            s,
            (tree, None),
        )
    }

    /// Prefilling n tokens at once equals feeding them one at a time (causality + cache reuse),
    /// whatever blocks the table names.
    #[test]
    fn prefill_equals_incremental_decode_through_any_table() {
        let s = AttnShape::new(4, 2, 8);
        let m = 11;
        let (q, k, v) = (gen(m * 32, 7), gen(m * 16, 5), gen(m * 16, 3));
        let mut c1 = pool(DType::F32, 4, s);
        let all = feed(&mut c1, &[0, 1, 2], (&q, &k, &v), 0..m, s, None);
        let mut c2 = pool(DType::F32, 4, s);
        for r in 0..m {
            let one = feed(&mut c2, &[9, 3, 14], (&q, &k, &v), r..r + 1, s, None);
            for (a, b) in one.iter().zip(&all[r * 32..(r + 1) * 32]) {
                assert!((a - b).abs() < 1e-5);
            }
        }
        // The scattered table took memory up to its highest block only.
        assert_eq!(c2.bytes(), 2 * 15 * 4 * 16 * 4);
        // first row attends only to itself: output = v of kv head
        assert!((all[0] - v[0]).abs() < 1e-6 && (all[16] - v[8]).abs() < 1e-6);
    }

    /// A step of `HEADS_APART_FROM` rows and more (which reads a copy laid out head by head) gives
    /// each row the bits it gets fed alone (read in place, or from a copy position by position):
    /// f32 and quantized (rotated) pools, shared keys and values, a sliding window, a tree.
    #[test]
    fn many_rows_read_head_by_head_give_each_rows_bits_alone() {
        let m = HEADS_APART_FROM + 5;
        let base = AttnShape::new(8, 2, 32);
        let chain: Vec<u64> = (0..m).map(|i| (1u64 << (i + 1)) - 1).collect();
        let cases = [
            (DType::F32, base, false),
            (DType::Q8_0, base, false),
            (DType::F16, AttnShape { shared_kv: true, ..base }, false),
            (DType::F32, AttnShape { window: 5, ..base }, false),
            (DType::F32, base, true),
        ];
        for (d, s, tree) in cases {
            let (q, k, v) = (gen(m * 256, 7), gen(m * 64, 5), gen(m * 64, 3));
            let table = [3, 0, 7, 1, 5, 2];
            let mask = tree.then_some(&chain[..]);
            let all = feed(&mut pool(d, 4, s), &table, (&q, &k, &v), 0..m, s, mask);
            let mut one = pool(d, 4, s);
            for r in 0..m {
                let got = feed(&mut one, &table, (&q, &k, &v), r..r + 1, s, None);
                let want = &all[r * 256..(r + 1) * 256];
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(want), "{d:?} {s:?} tree {tree}: row {r}");
            }
        }
    }

    /// A sliding window equals full attention over only the last `window` positions.
    #[test]
    fn window_attends_to_the_last_positions() {
        let w = 3;
        let s = AttnShape { window: w, ..AttnShape::new(2, 1, 4) };
        let n = 20;
        let (q, k, v) = (gen(n * 8, 7), gen(n * 4, 5), gen(n * 4, 3));
        let table: Vec<u32> = (0..16).rev().collect();
        let mut c = pool(DType::F32, 2, s);
        for r in 0..n {
            let got = feed(&mut c, &table, (&q, &k, &v), r..r + 1, s, None);
            // Reference: full attention over rows max(0, r + 1 - w)..=r only.
            let lo = (r + 1).saturating_sub(w);
            let full = AttnShape::new(2, 1, 4);
            let mut p = pool(DType::F32, 2, full);
            let qs: Vec<f32> =
                (lo..=r).flat_map(|_| q[r * 8..(r + 1) * 8].iter().copied()).collect();
            let want =
                feed(&mut p, &[0, 1], (&qs, &k[lo * 4..], &v[lo * 4..]), 0..r + 1 - lo, full, None);
            for (a, b) in got.iter().zip(&want[(r - lo) * 8..]) {
                assert!((a - b).abs() < 1e-5, "row {r}");
            }
        }
    }

    /// A tree's row attends to the cache and its ancestors only: each root-to-leaf path of a tree
    /// equals that path fed alone (causal), row for row.
    #[test]
    fn tree_rows_see_their_ancestors_only() {
        let s = AttnShape::new(2, 1, 4);
        let (q, k, v) = (gen(8 * 8, 7), gen(8 * 4, 5), gen(8 * 4, 3));
        // Two cached positions, then a tree of 5 rows: 0 → {1, 2}, 1 → 3, 2 → 4.
        let anc: Vec<u64> = vec![0b1, 0b11, 0b101, 0b1011, 0b10101];
        let mut c = pool(DType::F32, 4, s);
        feed(&mut c, &[5, 6], (&q, &k, &v), 0..2, s, None);
        let got = feed(&mut c, &[5, 6], (&q, &k, &v), 2..7, s, Some(&anc));
        for path in [[0usize, 1, 3], [0, 2, 4]] {
            let idx: Vec<usize> = [0, 1].into_iter().chain(path.iter().map(|r| 2 + r)).collect();
            let rows = |x: &[f32], w: usize| -> Vec<f32> {
                idx.iter().flat_map(|&r| x[r * w..(r + 1) * w].to_vec()).collect()
            };
            let mut p = pool(DType::F32, 4, s);
            let want =
                feed(&mut p, &[0, 1], (&rows(&q, 8), &rows(&k, 4), &rows(&v, 4)), 0..5, s, None);
            for (i, &r) in path.iter().enumerate() {
                for (a, b) in got[r * 8..(r + 1) * 8].iter().zip(&want[(2 + i) * 8..(3 + i) * 8]) {
                    assert!((a - b).abs() < 1e-5, "path {path:?} row {r}");
                }
            }
        }
    }

    /// A tree grown over two calls (its first rows cached by the first, masks of the second over
    /// all of them from `tree_from`) gives the rows of the second call what one call gives them;
    /// a `tree_from` past `start` is refused.
    #[test]
    fn a_tree_grown_over_two_calls_equals_one_call() {
        let s = AttnShape::new(2, 1, 4);
        let (q, k, v) = (gen(8 * 8, 7), gen(8 * 4, 5), gen(8 * 4, 3));
        // Two cached positions, then 0 → {1, 2}, 1 → 3, 2 → 4: rows 0-2 in one call, 3-4 later.
        let anc: Vec<u64> = vec![0b1, 0b11, 0b101, 0b1011, 0b10101];
        let mut one = pool(DType::F32, 4, s);
        feed(&mut one, &[5, 6], (&q, &k, &v), 0..2, s, None);
        let whole = feed(&mut one, &[5, 6], (&q, &k, &v), 2..7, s, Some(&anc));
        let mut two = pool(DType::F32, 4, s);
        feed(&mut two, &[1, 3], (&q, &k, &v), 0..2, s, None);
        feed(&mut two, &[1, 3], (&q, &k, &v), 2..5, s, Some(&anc[..3]));
        let (qd, kvd) = (8, 4);
        let seq = KvSeq { table: &[1, 3], start: 5, tree_from: 2 };
        let (q2, k2, v2) = (&q[5 * qd..7 * qd], &k[5 * kvd..7 * kvd], &v[5 * kvd..7 * kvd]);
        let grown = attention(q2, k2, v2, 2, &mut two, seq, s, (Some(&anc[3..]), None));
        for (a, b) in grown.iter().zip(&whole[3 * qd..]) {
            assert!((a - b).abs() < 1e-6, "{grown:?} vs {:?}", &whole[3 * qd..]);
        }
        let late = KvSeq { table: &[1, 3], start: 5, tree_from: 6 };
        assert!(late.tree(Some(&anc[3..])).is_err());
        let bad_own_bit = s.check((2, 8), (2, 4), (2, 4), seq.tree(Some(&anc[1..3])).unwrap());
        assert!(bad_own_bit.is_err());
    }

    /// A sink joins each head's softmax denominator only: a row that sees one position gets that
    /// value times σ(score − sink), and every output shrinks by the sink's share.
    #[test]
    fn sinks_take_their_share_of_the_softmax() {
        let s = AttnShape::new(2, 1, 4);
        let (q, k, v) = (gen(5 * 8, 7), gen(5 * 4, 5), gen(5 * 4, 3));
        let sinks = [0.7f32, -1.3];
        let plain = feed(&mut pool(DType::F32, 4, s), &[0, 1], (&q, &k, &v), 0..5, s, None);
        let seq = KvSeq::new(&[0, 1], 0);
        let mut p = pool(DType::F32, 4, s);
        let got = attention(&q, &k, &v, 5, &mut p, seq, s, (None, Some(&sinks)));
        for h in 0..2 {
            let score = crate::quant::dot(&q[h * 4..h * 4 + 4], &k[..4]) * s.scale;
            let share = 1.0 / (1.0 + (sinks[h] - score).exp());
            for j in 0..4 {
                assert!((got[h * 4 + j] - v[j] * share).abs() < 1e-6, "head {h}");
            }
        }
        // Later rows: the same direction as without the sink, shorter.
        for r in 1..5 {
            let (a, b) = (&got[r * 8..r * 8 + 4], &plain[r * 8..r * 8 + 4]);
            let ratio = a[0] / b[0];
            assert!(ratio > 0.0 && ratio < 1.0, "row {r}");
            for (x, y) in a.iter().zip(b) {
                assert!((x - y * ratio).abs() < 1e-5, "row {r}");
            }
        }
    }

    /// Shared keys and values (MLA's latent) equal attention fed the keys as values, from a pool
    /// holding half the bytes; its blocks read out and back hold keys only.
    #[test]
    fn shared_kv_reads_values_from_the_keys() {
        let s = AttnShape::new(4, 1, 32);
        let shared = AttnShape { shared_kv: true, ..s };
        let (q, k) = (gen(9 * 128, 7), gen(9 * 32, 5));
        for d in [DType::F32, DType::Q8_0] {
            let want = feed(&mut pool(d, 4, s), &[0, 1, 2], (&q, &k, &k), 0..9, s, None);
            let mut p = pool(d, 4, shared);
            let ignored = vec![f32::NAN; k.len()];
            let got = feed(&mut p, &[0, 1, 2], (&q, &k, &ignored), 0..9, shared, None);
            assert_eq!(got, want, "{d:?}");
            let mut full = pool(d, 4, s);
            feed(&mut full, &[0, 1, 2], (&q, &k, &k), 0..9, s, None);
            assert_eq!(2 * p.bytes(), full.bytes());
            assert_eq!(2 * p.read_block(1).len(), full.read_block(1).len());
            let mut back = pool(d, 4, shared);
            back.write_block(1, &p.read_block(1)).unwrap();
            assert_eq!(back.read_block(1), p.read_block(1));
        }
    }

    /// Positions written again (a rejected draft's) equal never having written the rejected rows.
    #[test]
    fn rewritten_positions_forget_rejected_rows() {
        let s = AttnShape::new(2, 1, 4);
        let (q, k, v) = (gen(6 * 8, 7), gen(6 * 4, 5), gen(6 * 4, 3));
        let mut plain = pool(DType::F32, 2, s);
        let want = feed(&mut plain, &[0, 1, 2], (&q, &k, &v), 0..6, s, None);
        let mut c = pool(DType::F32, 2, s);
        feed(&mut c, &[0, 1, 2], (&q, &k, &v), 0..3, s, None);
        // Two rejected rows (other keys) at positions 3 and 4, then those positions again.
        feed(&mut c, &[0, 1, 2], (&q, &v, &k), 3..5, s, None);
        let got = feed(&mut c, &[0, 1, 2], (&q, &k, &v), 3..6, s, None);
        for (a, b) in got.iter().zip(&want[3 * 8..]) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    /// A block read out and written into another block of another pool reads back the same (a
    /// sequence swapped to host RAM and back computes as if it had stayed).
    #[test]
    fn blocks_read_out_and_written_back_compute_the_same() {
        let s = AttnShape::new(2, 1, 32);
        let (q, k, v) = (gen(9 * 64, 7), gen(9 * 32, 5), gen(9 * 32, 3));
        let mut a = pool(DType::Q8_0, 4, s);
        feed(&mut a, &[2, 0, 5], (&q, &k, &v), 0..8, s, None);
        let want = feed(&mut a, &[2, 0, 5], (&q, &k, &v), 8..9, s, None);
        let mut b = pool(DType::Q8_0, 4, s);
        for (from, to) in [(2, 7), (0, 1)] {
            b.write_block(to, &a.read_block(from)).unwrap();
        }
        let got = feed(&mut b, &[7, 1, 3], (&q, &k, &v), 8..9, s, None);
        assert_eq!(got, want);
        assert!(b.write_block(16, &a.read_block(0)).is_err());
        assert!(b.write_block(1, &[0; 8]).is_err());
    }

    /// Smaller dtypes give the f32 pool's outputs within their precision.
    #[test]
    fn smaller_dtypes_stay_close_to_f32() {
        let s = AttnShape::new(4, 2, 64);
        let m = 40;
        let (q, k, v) = (gen(m * 256, 7), gen(m * 128, 5), gen(m * 128, 3));
        let mut exact = pool(DType::F32, 16, s);
        let want = feed(&mut exact, &[1, 0, 3], (&q, &k, &v), 0..m, s, None);
        for (d, tol) in
            [(DType::F16, 1e-3), (DType::Bf16, 1e-2), (DType::Q8_0, 1e-2), (DType::Q4_0, 0.2)]
        {
            let mut p = pool(d, 16, s);
            let got = feed(&mut p, &[1, 0, 3], (&q, &k, &v), 0..m, s, None);
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < tol, "{d:?}: {err}");
            assert!(p.bytes() < exact.bytes() || d == DType::F32);
        }
    }
}
