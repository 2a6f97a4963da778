//! How the head stage turns a step's logits into tokens, chosen once per step: argmax on the device
//! (every row greedy, no log-probabilities: one id per row comes back), sampling on the device
//! (penalty, temperature, top-k/top-p and the draw there: ids come back), or sampling on the host
//! (log-probabilities need the logits there; also every backend that cannot sample).

use crate::error::Result;
use crate::sampling::{sample_batch, seen, Sampler};
use layerstream_kernels::{Backend, RowPick};
use layerstream_rpc::v1::TokenLogprobs;
use tracing::info_span;

/// One sequence's row of the step's logits, as the head sees it.
pub struct HeadRow<'a> {
    pub(crate) sampler: &'a mut Sampler,
    /// Tokens it has seen (prompt and output), for the repetition penalty.
    pub(crate) history: &'a [u32],
    /// A prompt chunk samples nothing: that would advance a seeded generator.
    pub(crate) prompt_continues: bool,
    /// The tokens its output format allows (a bitmask; empty: every token).
    pub(crate) allowed: &'a [u32],
}

/// Where a step's tokens are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenChoice {
    DeviceArgmax,
    DeviceSampling,
    HostSampling,
}

/// The step's tokens and, where asked, their log-probabilities (empty: none asked).
pub type Chosen = (Vec<u32>, Vec<Option<TokenLogprobs>>);

impl TokenChoice {
    /// The cheapest way that gives every row what it asked for on backend `b`.
    pub fn for_rows<B: Backend>(b: &B, rows: &[HeadRow<'_>]) -> Self {
        let logprobs = rows.iter().any(|r| r.sampler.params.logprobs.is_some());
        // Biases, OpenAI's penalties, bans and masks are applied on the host.
        let host = rows.iter().any(|r| r.sampler.params.adjusts() || !r.allowed.is_empty());
        if rows.iter().all(|r| r.sampler.is_greedy() && r.allowed.is_empty()) && !logprobs {
            TokenChoice::DeviceArgmax
        } else if b.samples_on_device() && !logprobs && !host {
            TokenChoice::DeviceSampling
        } else {
            TokenChoice::HostSampling
        }
    }

    /// Chooses every row's token from `logits` (one row per sequence, in `rows` order).
    pub fn choose<B: Backend>(
        self,
        b: &B,
        logits: &mut B::Tensor,
        rows: Vec<HeadRow<'_>>,
    ) -> Result<Chosen> {
        match self {
            TokenChoice::DeviceArgmax => Ok((b.argmax_rows(logits)?, Vec::new())),
            TokenChoice::DeviceSampling => on_device(b, logits, rows),
            TokenChoice::HostSampling => on_host(b, logits, rows),
        }
    }
}

/// Samples on the device; a row with more candidates than the device sorts comes back unsampled
/// and is sampled on the host from its row (penalised already) with the same draw.
fn on_device<B: Backend>(b: &B, logits: &mut B::Tensor, rows: Vec<HeadRow<'_>>) -> Result<Chosen> {
    let _in_sample = info_span!("sample", rows = rows.len() as i64, device = true).entered();
    let picks: Vec<_> = rows
        .into_iter()
        .map(|r| {
            (!r.prompt_continues)
                .then(|| (r.sampler.pick(), r.sampler.draw(), seen(&r.sampler.params, r.history)))
        })
        .collect();
    let jobs: Vec<_> = picks
        .iter()
        .map(|p| p.as_ref().map(|(pick, r, seen)| RowPick { pick: *pick, r: *r, seen }))
        .collect();
    let picked = b.sample_rows(logits, &jobs)?;
    let mut tokens = Vec::with_capacity(picked.len());
    for (i, (t, p)) in picked.into_iter().zip(&picks).enumerate() {
        tokens.push(match (t, p) {
            (Some(t), _) => t,
            (None, None) => 0,
            (None, Some((pick, r, _))) => {
                let mut host = b.to_host(&b.rows(logits, i, 1)?)?;
                layerstream_kernels::host::check_logits(&host, i)?;
                crate::sampling::choose(&mut host, &[], pick, *r)
            }
        });
    }
    let n = tokens.len();
    Ok((tokens, vec![None; n]))
}

/// One copy of the step's logits to the host; each sequence samples from its own row of it.
fn on_host<B: Backend>(b: &B, logits: &mut B::Tensor, rows: Vec<HeadRow<'_>>) -> Result<Chosen> {
    let mut host = b.to_host(logits)?;
    let vocab = b.dims(logits).1;
    let jobs: Vec<_> = rows
        .into_iter()
        .zip(host.chunks_exact_mut(vocab))
        .map(|(r, l)| (!r.prompt_continues).then_some((r.sampler, r.history, l, r.allowed)))
        .collect();
    let _in_sample = info_span!("sample", rows = jobs.iter().flatten().count() as i64).entered();
    Ok(sample_batch(jobs)?.into_iter().unzip())
}
