//! Host sampling cost per decode step, side by side: the candidates by a full sort of the vocabulary
//! (what sampling did before) vs `Sampler::sample` now (selection, or for untruncated sampling no
//! order at all; the row copied first), per row, and a batch of 64 rows sampled one by one with full
//! sorts vs `sample_batch` (spread over the cores).
//! Run: `cargo bench -p layerstream-worker --bench sampling`.

use layerstream_worker::nucleus::{full_sort_nucleus, nucleus};
use layerstream_worker::{sample_batch, Sampler, SamplingParams};
use std::hint::black_box;
use std::time::Instant;

/// Normal logits (Box–Muller over a fixed LCG) with standard deviation `sd` and one token `lead`
/// above the rest: `sd` 3 / lead 8 is peaked like a chat model's next-token logits, `sd` 1 flat.
fn logits(vocab: usize, sd: f32, lead: f32, seed: u64) -> Vec<f32> {
    let mut state = seed;
    let mut u = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    };
    let mut l: Vec<f32> = (0..vocab)
        .map(|_| ((-2.0 * u().ln()).sqrt() * (2.0 * std::f64::consts::PI * u()).cos()) as f32 * sd)
        .collect();
    l[vocab / 3] += lead;
    l
}

/// Median milliseconds of `reps` runs of `f`.
fn ms(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[reps / 2]
}

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("host sampling, {threads} threads available; times are medians");
    println!("| vocab | logits | params | nucleus size | full sort ms/row | sample ms/row | ratio | batch 64 one by one, full sort ms | batch 64 sample_batch ms | ratio |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let cases = [(0.7, 0, 0.9), (0.7, 50, 1.0), (0.7, 50, 0.9), (1.0, 0, 1.0)];
    for vocab in [49_152, 128_256] {
        for (shape, sd, lead) in [("peaked", 3.0, 8.0), ("flat", 1.0, 0.0)] {
            let rows: Vec<Vec<f32>> = (0..64).map(|j| logits(vocab, sd, lead, j)).collect();
            for (temperature, top_k, top_p) in cases {
                let p = SamplingParams { temperature, top_k, top_p, seed: 1, ..Default::default() };
                let pick = Sampler::new(p.clone()).pick();
                let size = if top_k == 0 && top_p >= 1.0 {
                    vocab
                } else {
                    nucleus(&rows[0], &pick).0.len()
                };
                let full = ms(9, || drop(black_box(full_sort_nucleus(&rows[0], &pick))));
                let mut one = Sampler::new(p.clone());
                let sel = ms(9, || {
                    black_box(one.sample(&mut rows[0].clone(), &[]));
                });
                let old_batch = ms(3, || {
                    rows.iter().for_each(|r| drop(black_box(full_sort_nucleus(r, &pick))))
                });
                let mut samplers: Vec<Sampler> = (0..64).map(|_| Sampler::new(p.clone())).collect();
                let new_batch = ms(5, || {
                    // The step's logits arrive as one host buffer (copied here, as from the device).
                    let mut host: Vec<f32> = rows.concat();
                    let jobs = samplers
                        .iter_mut()
                        .zip(host.chunks_exact_mut(vocab))
                        .map(|(s, r)| Some((s, &[][..], r, &[][..])))
                        .collect();
                    drop(black_box(sample_batch(jobs).expect("finite logits")));
                });
                let name = format!("T {temperature}, top-k {top_k}, top-p {top_p}");
                println!("| {vocab} | {shape} | {name} | {size} | {full:.2} | {sel:.2} | {:.1}× | {old_batch:.0} | {new_batch:.1} | {:.1}× |", full / sel, old_batch / new_batch);
            }
        }
    }
}
