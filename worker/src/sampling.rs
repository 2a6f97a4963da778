//! Token sampling: repetition penalty, temperature, top-k, top-p, seeded randomness; greedy at
//! temperature 0. Same seed and logits → same tokens. Candidates are selected (`nucleus`), not
//! sorted out of the whole vocabulary; a step's sequences are sampled on several threads.

use layerstream_kernels::host::check_logits;
pub use layerstream_kernels::sampling::{choose, Pick};
use layerstream_rpc::v1::TokenLogprobs;
pub use layerstream_serving::SamplingParams;

/// A sampler with its own random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    pub params: SamplingParams,
    state: u64,
}

impl Sampler {
    /// Creates a sampler seeded from `params.seed`.
    pub fn new(mut params: SamplingParams) -> Self {
        if params.temperature < layerstream_serving::generation::GREEDY_BELOW {
            params.temperature = 0.0;
        }
        let state = params.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler { params, state }
    }

    /// Advances the generator past `n` draws (a sequence resumed after a fault: each sampled token
    /// drew once), so it continues exactly where the interrupted one stood.
    pub fn skip(&mut self, n: u64) {
        self.state = self.state.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }

    /// splitmix64 → uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Whether `sample` is a plain argmax (temperature 0, no penalty, bias or ban): the head can
    /// then pick the token on the device without copying the logits back.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0
            && self.params.repetition_penalty == 1.0
            && !self.params.adjusts()
    }

    /// The truncation and penalty this sampler applies.
    pub fn pick(&self) -> Pick {
        let p = &self.params;
        Pick {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            repetition_penalty: p.repetition_penalty,
        }
    }

    /// This step's uniform draw (0 without drawing when greedy): one per sampled token, whether the
    /// host or the device then picks with it.
    pub fn draw(&mut self) -> f32 {
        if self.pick().draws() {
            self.uniform() as f32
        } else {
            0.0
        }
    }

    /// Picks the next token from `logits` given the tokens seen so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.sample_within(logits, history, &[])
    }

    /// As `sample`, among the tokens `allowed` permits (a bitmask; empty: every token).
    pub fn sample_within(&mut self, logits: &mut [f32], history: &[u32], allowed: &[u32]) -> u32 {
        adjust(&self.params, logits, history, allowed);
        let r = self.draw();
        choose(logits, &seen(&self.params, history), &self.pick(), r)
    }
}

/// What a request changes in a row of logits before the choice: its logit biases, OpenAI's
/// frequency and presence penalties over the output (the tokens after `prompt_len`), the ban of
/// end-of-sequence and stop ids before `min_tokens`, and the output format's mask (`allowed`, a
/// bitmask of the tokens it permits; empty: every token).
pub fn adjust(p: &SamplingParams, logits: &mut [f32], history: &[u32], allowed: &[u32]) {
    for &(t, b) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
    let output = &history[p.prompt_len.min(history.len())..];
    if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        let mut ids = output.to_vec();
        ids.sort_unstable();
        for run in ids.chunk_by(|a, b| a == b) {
            if let Some(l) = logits.get_mut(run[0] as usize) {
                *l -= run.len() as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
    }
    if output.len() < p.min_tokens {
        for &t in p.eos_ids.iter().chain(&p.stop_token_ids) {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    if !allowed.is_empty() {
        for (t, l) in logits.iter_mut().enumerate() {
            if allowed.get(t / 32).is_none_or(|w| w >> (t % 32) & 1 == 0) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// The ids a repetition penalty applies to (each once; none when there is no penalty).
pub fn seen(p: &SamplingParams, history: &[u32]) -> Vec<u32> {
    if p.repetition_penalty == 1.0 {
        return Vec::new();
    }
    let mut seen = history.to_vec();
    seen.sort_unstable();
    seen.dedup();
    seen
}

/// Log-probabilities of `chosen` and of the `k` most likely tokens under `logits` (raw: before
/// temperature, penalties and truncation), computed in f64.
pub fn logprobs(logits: &[f32], chosen: u32, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    let lp = |t: usize| (logits[t] as f64 - lse) as f32;
    let k = k.min(logits.len());
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit =
        |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_logit);
    }
    idx.truncate(k);
    idx.sort_unstable_by(by_logit);
    TokenLogprobs {
        logprob: lp(chosen as usize),
        top_logprobs: idx.iter().map(|&t| lp(t as usize)).collect(),
        top_ids: idx,
    }
}

/// One token sampled for a sequence, with its log-probabilities when they were asked for.
pub type Sampled = (u32, Option<TokenLogprobs>);

/// One sequence's share of a step's sampling: its sampler, the tokens it has seen, its logits (a
/// row of the step's logits on the host, penalised in place), the tokens its format allows (a
/// bitmask; empty: every token).
pub type SampleJob<'a> = (&'a mut Sampler, &'a [u32], &'a mut [f32], &'a [u32]);

/// Logit values below which a batch is sampled on the calling thread (spawning costs more).
const PARALLEL_MIN_LOGITS: usize = 1 << 20;

/// Samples every job's next token (`None`, a prompt chunk that samples nothing, gives 0) and, for a
/// job that asks, its log-probabilities from the logits as they were before sampling; spreading
/// the jobs over the machine's cores when the batch's logits are many: a 128k-token vocabulary at
/// batch 64 is 8M values, tens of milliseconds on one core. A job whose logits hold a NaN or an
/// infinity fails the batch, naming its index (checked on the thread that samples it).
pub fn sample_batch(
    mut jobs: Vec<Option<SampleJob<'_>>>,
) -> layerstream_kernels::Result<Vec<Sampled>> {
    let total: usize = jobs.iter().flatten().map(|j| j.2.len()).sum();
    let threads = layerstream_kernels::cpu::threads::cpu_threads().min(jobs.len());
    // `first`: the batch index of the chunk's first job.
    let run = |first: usize,
               chunk: &mut [Option<SampleJob<'_>>]|
     -> layerstream_kernels::Result<Vec<Sampled>> {
        let sample = |(i, job): (usize, &mut Option<SampleJob<'_>>)| match job {
            None => Ok((0, None)),
            Some((s, history, logits, allowed)) => {
                check_logits(logits, first + i)?;
                // Sampling penalises the row in place: keep the raw logits the log-probs need.
                let raw = s.params.logprobs.map(|k| (k, logits.to_vec()));
                let t = s.sample_within(logits, history, allowed);
                Ok((t, raw.map(|(k, raw)| logprobs(&raw, t, k))))
            }
        };
        chunk.iter_mut().enumerate().map(sample).collect()
    };
    if total < PARALLEL_MIN_LOGITS || threads < 2 {
        return run(0, &mut jobs);
    }
    let per = jobs.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .chunks_mut(per)
            .enumerate()
            .map(|(c, chunk)| scope.spawn(move || run(c * per, chunk)))
            .collect();
        let parts: Vec<Vec<Sampled>> = handles
            .into_iter()
            .map(|h| h.join().expect("a sampling thread panicked"))
            .collect::<layerstream_kernels::Result<_>>()?;
        Ok(parts.concat())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_kernels::host::argmax;

    fn logits() -> Vec<f32> {
        (0..50).map(|i| ((i * 37) % 23) as f32 * 0.3).collect()
    }

    /// A temperature too small to divide by is greedy, not token 0 (logits / 1e-38 overflow f32).
    #[test]
    fn a_vanishing_temperature_is_greedy() {
        let want = argmax(&logits()) as u32;
        assert_ne!(want, 0);
        for t in [1e-38f32, 1e-20, 1e-6] {
            let mut s =
                Sampler::new(SamplingParams { temperature: t, seed: 3, ..Default::default() });
            assert_eq!(s.sample(&mut logits(), &[]), want, "temperature {t}");
            assert!(s.is_greedy());
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        let mut l = logits();
        let want = argmax(&l) as u32;
        assert_eq!(s.sample(&mut l, &[]), want);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let p = SamplingParams { temperature: 1.5, seed: 42, ..Default::default() };
        let run = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..40).map(|_| s.sample(&mut logits(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(&p), run(&p));
        assert_ne!(run(&p), run(&SamplingParams { seed: 43, ..p.clone() }));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_limits_support() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 2.0,
            top_k: 1,
            seed: 1,
            ..Default::default()
        });
        let want = argmax(&logits()) as u32;
        for _ in 0..10 {
            assert_eq!(s.sample(&mut logits(), &[]), want);
        }
        let mut l = vec![0.0f32; 10];
        l[3] = 10.0;
        l[7] = 9.0;
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: 5,
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut l.clone(), &[]), 3);
        }
    }

    #[test]
    fn repetition_penalty_moves_greedy_choice() {
        let mut l = vec![2.0f32, 1.9, -1.0];
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.2, ..Default::default() });
        assert_eq!(s.sample(&mut l, &[0]), 1);
        assert!((l[0] - 2.0 / 1.2).abs() < 1e-6);
    }

    /// Biases, OpenAI's penalties (output tokens only), the min_tokens ban and a format's mask,
    /// each moving the greedy choice as it should.
    #[test]
    fn adjustments_move_the_choice() {
        let base = vec![3.0f32, 2.9, 2.8, 0.0, -1.0];
        let greedy = |p: SamplingParams, history: &[u32], allowed: &[u32]| {
            Sampler::new(p).sample_within(&mut base.clone(), history, allowed)
        };
        let p = SamplingParams::default();
        assert_eq!(greedy(p.clone(), &[], &[]), 0);
        let bias = SamplingParams { logit_bias: vec![(4, 4.5)], ..p.clone() };
        assert_eq!(greedy(bias, &[], &[]), 4);
        // Token 0 twice in the output, token 1 once; the prompt's token 2 does not count.
        let hist = [2u32, 2, 0, 1, 0];
        // 0: 3.0 - 2 × 0.15 = 2.7; 1: 2.9 - 0.15 = 2.75; 2: 2.8 untouched.
        let freq = SamplingParams { frequency_penalty: 0.15, prompt_len: 2, ..p.clone() };
        assert_eq!(greedy(freq.clone(), &hist, &[]), 2);
        // 0: 2.75; 1: 2.65; 2: 2.8.
        let pres = SamplingParams { presence_penalty: 0.25, prompt_len: 2, ..p.clone() };
        assert_eq!(greedy(pres, &hist, &[]), 2);
        // Counting the prompt too, every id is penalised alike: 0 stays first.
        let counted_prompt = SamplingParams { presence_penalty: 0.25, prompt_len: 0, ..p.clone() };
        assert_eq!(greedy(counted_prompt, &hist, &[]), 0);
        let min = SamplingParams {
            min_tokens: 2,
            eos_ids: vec![0],
            stop_token_ids: vec![1],
            prompt_len: 4,
            ..p.clone()
        };
        assert_eq!(
            greedy(min.clone(), &[9, 9, 9, 9, 7], &[]),
            2,
            "one output token: 0 and 1 banned"
        );
        assert_eq!(greedy(min, &[9, 9, 9, 9, 7, 7], &[]), 0, "two: free again");
        assert_eq!(greedy(p.clone(), &[], &[0b11000]), 3, "only 3 and 4 allowed");
        assert!(!Sampler::new(freq).is_greedy(), "an adjusted row is sampled on the host");
    }

    #[test]
    fn untruncated_sampling_follows_the_softmax() {
        // Probabilities 1/15, 2/15, 4/15, 8/15 at temperature 1 (ids deliberately not sorted).
        let l = [8f32.ln(), 1f32.ln(), 4f32.ln(), 2f32.ln()];
        let want = [8.0 / 15.0, 1.0 / 15.0, 4.0 / 15.0, 2.0 / 15.0];
        let mut s =
            Sampler::new(SamplingParams { temperature: 1.0, seed: 9, ..Default::default() });
        let mut counts = [0usize; 4];
        let n = 20_000;
        for _ in 0..n {
            counts[s.sample(&mut l.clone(), &[]) as usize] += 1;
        }
        for (c, w) in counts.iter().zip(want) {
            // Binomial standard deviation ≤ 0.0036 here: 0.015 is over four of them.
            assert!((*c as f64 / n as f64 - w).abs() < 0.015, "frequencies {counts:?} vs {want:?}");
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_raw_logits_most_likely_first() {
        let l = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        // The softmax by hand: exp(l) / Σ exp(l).
        let z: f32 = l.iter().map(|x| x.exp()).sum();
        let want = |t: usize| (l[t].exp() / z).ln();
        let lp = logprobs(&l, 4, 3);
        assert!((lp.logprob - want(4)).abs() < 1e-6);
        // Ties keep the lower id first; then the next most likely.
        assert_eq!(lp.top_ids, vec![1, 3, 0]);
        for (t, v) in lp.top_ids.iter().zip(&lp.top_logprobs) {
            assert!((v - want(*t as usize)).abs() < 1e-6);
        }
        assert!(logprobs(&l, 0, 0).top_ids.is_empty());
        assert_eq!(logprobs(&l, 0, 9).top_ids.len(), 5, "no more alternatives than tokens");
    }

    #[test]
    fn a_batch_sampled_across_threads_equals_one_by_one() {
        // 24 sequences of a 60k vocabulary: over PARALLEL_MIN_LOGITS, so the threads run.
        let (n, vocab) = (24, 60_000);
        let logits = |j: usize| -> Vec<f32> {
            (0..vocab).map(|i| ((i * 31 + j * 17) % 997) as f32 / 60.0).collect()
        };
        let params = |j: usize| SamplingParams {
            temperature: 0.8,
            top_k: [0, 40][j % 2],
            top_p: 0.9,
            repetition_penalty: 1.1,
            seed: j as u64,
            logprobs: j.is_multiple_of(4).then_some(j % 3),
            ..Default::default()
        };
        let history: Vec<Vec<u32>> = (0..n).map(|j| vec![j as u32, 5, 900]).collect();
        let mut solo: Vec<Sampler> = (0..n).map(|j| Sampler::new(params(j))).collect();
        let mut batch = solo.clone();
        for round in 0..3 {
            // Every third sequence is a prompt chunk this round: it samples nothing, gets 0.
            let skip = |j: usize| (j + round).is_multiple_of(3);
            let want: Vec<u32> = (0..n)
                .map(|j| if skip(j) { 0 } else { solo[j].sample(&mut logits(j), &history[j]) })
                .collect();
            let mut rows: Vec<Vec<f32>> = (0..n).map(logits).collect();
            let jobs = batch
                .iter_mut()
                .zip(&mut rows)
                .enumerate()
                .map(|(j, (s, l))| {
                    (!skip(j)).then(|| (s, history[j].as_slice(), l.as_mut_slice(), &[][..]))
                })
                .collect();
            assert!(n * vocab >= PARALLEL_MIN_LOGITS);
            let got = sample_batch(jobs).unwrap();
            assert_eq!(got.iter().map(|s| s.0).collect::<Vec<_>>(), want, "round {round}");
            for (j, (t, lp)) in got.iter().enumerate() {
                // Log-probs come from the raw row, not the one penalised while sampling.
                let expect =
                    params(j).logprobs.filter(|_| !skip(j)).map(|k| logprobs(&logits(j), *t, k));
                assert_eq!(lp, &expect, "round {round} row {j}");
            }
        }
        // A non-finite row fails the batch, named by its index in the batch (job 17 runs on a thread
        // whose chunk starts past 0).
        let mut rows: Vec<Vec<f32>> = (0..n).map(logits).collect();
        rows[17][123] = f32::NAN;
        let jobs = batch
            .iter_mut()
            .zip(&mut rows)
            .enumerate()
            .map(|(j, (s, l))| Some((s, history[j].as_slice(), l.as_mut_slice(), &[][..])))
            .collect();
        let e = sample_batch(jobs).unwrap_err().to_string();
        assert!(e.contains("row 17") && e.contains("logit 123"), "{e}");
    }
}
