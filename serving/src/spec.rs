//! Speculative decoding's pure logic, shared by `run` and the coordinator: which drafter, a request's
//! draft limits, prompt-lookup (n-gram) proposals, each sequence's acceptance estimate, the measured
//! cost of a pass by positions, and the draft size that maximises expected tokens per second.
//!
//! Verification is exact: every drafted position is sampled from the target as if there were no
//! draft (the same sampler, the same draw), a draft token is accepted while it equals that sample,
//! and the first sample that differs is emitted in its place. For a deterministic draft (prompt
//! lookup, or a draft model's greedy choice) this is speculative sampling's rule — accept with
//! min(1, p/q) = p(d), else draw from norm(max(0, p − q)) = p without d — coupled so that the
//! output equals non-speculative sampling draw for draw, seed for seed.

use crate::{Field, RequestError};
use serde::{Deserialize, Serialize};

/// Most tokens one step may draft for a sequence (`--spec-max`, a request's `n_max`): within what a
/// KV cache can roll back (`KV_ROLLBACK` in the kernels, 256).
pub const MAX_DRAFT: usize = 64;

/// Most continuations per node, and nodes per draft pass, of a best-first draft tree
/// (`--spec-width`).
pub const MAX_WIDTH: usize = 4;

/// Longest and shortest n-grams prompt lookup matches (longest first).
pub const NGRAM_MAX: usize = 4;
pub const NGRAM_MIN: usize = 2;

/// Who drafts (`--spec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMode {
    /// One token per sequence per pass.
    #[default]
    Off,
    /// The draft model when one is given, else prompt lookup.
    Auto,
    /// Prompt lookup: the tokens that followed the last earlier occurrence of the newest n-gram.
    Ngram,
    /// The draft model (`--draft-model`).
    Draft,
}

impl std::str::FromStr for SpecMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "off" => SpecMode::Off,
            "auto" => SpecMode::Auto,
            "ngram" => SpecMode::Ngram,
            "draft" => SpecMode::Draft,
            _ => return Err(format!("{s:?} is not one of off, auto, ngram, draft")),
        })
    }
}

impl SpecMode {
    pub fn name(self) -> &'static str {
        match self {
            SpecMode::Off => "off",
            SpecMode::Auto => "auto",
            SpecMode::Ngram => "ngram",
            SpecMode::Draft => "draft",
        }
    }

    /// The drafter that runs given whether a draft model is loaded: `Off`, `Ngram` or `Draft`; an
    /// error when `draft` is asked for without a draft model.
    pub fn resolve(self, have_draft_model: bool) -> Result<SpecMode, String> {
        match (self, have_draft_model) {
            (SpecMode::Auto, true) => Ok(SpecMode::Draft),
            (SpecMode::Auto, false) => Ok(SpecMode::Ngram),
            (SpecMode::Draft, false) => Err("--spec draft needs --draft-model".into()),
            (m, _) => Ok(m),
        }
    }
}

/// A request's draft limits (gRPC `speculative { max_tokens, min_tokens }`, OpenAI
/// `speculative: {"n_max", "n_min"}`): `n_max` None = the server's `--spec-max`, 0 = no speculation
/// for this request; a proposal shorter than `n_min` is not verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SpecLimits {
    pub n_max: Option<usize>,
    pub n_min: usize,
}

impl SpecLimits {
    /// Refuses limits past `MAX_DRAFT` or a minimum above the maximum, naming the field.
    pub fn validate(&self) -> Result<(), RequestError> {
        if let Some(n) = self.n_max.filter(|&n| n > MAX_DRAFT) {
            return Err(RequestError::new(
                Field::SpecMax,
                format!("must be at most {MAX_DRAFT}, got {n}"),
            ));
        }
        if self.n_min > MAX_DRAFT || self.n_max.is_some_and(|m| m > 0 && self.n_min > m) {
            return Err(RequestError::new(
                Field::SpecMin,
                format!(
                    "{} exceeds the maximum of {}",
                    self.n_min,
                    self.n_max.unwrap_or(MAX_DRAFT)
                ),
            ));
        }
        Ok(())
    }

    /// The most this request may draft per step under a server limit of `server_max`.
    pub fn max(&self, server_max: usize) -> usize {
        self.n_max.map_or(server_max, |n| n.min(MAX_DRAFT))
    }
}

/// Prompt lookup: the tokens that followed the most recent earlier occurrence of the last `n`
/// tokens of `history` (n from `NGRAM_MAX` down to `NGRAM_MIN`), at most `max` of them; preferring
/// the most recent match with `max` tokens after it, else the one with the most. Empty when nothing
/// matches.
pub fn ngram_propose(history: &[u32], max: usize) -> Vec<u32> {
    let len = history.len();
    if max == 0 {
        return Vec::new();
    }
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        if len <= n {
            continue;
        }
        let tail = &history[len - n..];
        let mut best: Option<usize> = None;
        for i in (0..len - n).rev() {
            if &history[i..i + n] == tail {
                let from = i + n;
                if best.is_none_or(|b| len - from > len - b) {
                    best = Some(from);
                }
                if len - from >= max {
                    break;
                }
            }
        }
        if let Some(from) = best {
            return history[from..(from + max).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// One sequence's draft acceptance: of the drafted positions verification reached, how many it
/// accepted (a geometric model's estimate of the per-token acceptance rate), with a prior of
/// `PRIOR_RATE` worth `PRIOR_WEIGHT` positions so that a new sequence drafts before it has data.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Acceptance {
    /// Drafted tokens accepted.
    pub accepted: u64,
    /// Drafted positions verification reached (accepted ones plus one per rejection).
    pub tested: u64,
}

const PRIOR_RATE: f64 = 0.6;
const PRIOR_WEIGHT: f64 = 4.0;

impl Acceptance {
    /// Records a step that drafted `drafted` tokens and accepted the first `accepted`.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.accepted += accepted as u64;
        self.tested += (accepted + usize::from(accepted < drafted)) as u64;
    }

    /// The estimated chance that the next drafted token is accepted.
    pub fn rate(&self) -> f64 {
        (self.accepted as f64 + PRIOR_RATE * PRIOR_WEIGHT) / (self.tested as f64 + PRIOR_WEIGHT)
    }
}

/// Expected tokens one step emits for a sequence that drafts `k` tokens accepted each with
/// probability `a` (independently): 1 + a + … + a^k.
pub fn expected_tokens(a: f64, k: usize) -> f64 {
    (0..=k).map(|i| a.powi(i as i32)).sum()
}

/// The time of a weight pass as a function of the positions it carries, fitted online by least
/// squares over the steps seen (older ones fading): `ms ≈ base + per_position × positions`.
#[derive(Debug, Clone, Default)]
pub struct PassCost {
    // Exponentially faded sums: weight, x, y, x², xy.
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

/// How much each older step's weight fades per new step.
const FADE: f64 = 0.98;

impl PassCost {
    /// Records a pass of `positions` that took `ms`.
    pub fn record(&mut self, positions: usize, ms: f64) {
        let x = positions as f64;
        let f = FADE;
        (self.w, self.x, self.y, self.xx, self.xy) = (
            self.w * f + 1.0,
            self.x * f + x,
            self.y * f + ms,
            self.xx * f + x * x,
            self.xy * f + x * ms,
        );
    }

    /// Milliseconds predicted for a pass of `positions`; None before any pass was seen. Until the
    /// steps seen differ in size enough to fit a slope, each position is assumed to cost 1/16 of a
    /// one-position pass (a guess that the first drafts then correct).
    pub fn predict(&self, positions: usize) -> Option<f64> {
        if self.w == 0.0 {
            return None;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        let slope = if var > 0.25 {
            ((self.xy / self.w - mx * my) / var).max(0.0)
        } else {
            my / (16.0 * mx.max(1.0))
        };
        let base = (my - slope * mx).max(0.0);
        Some(base + slope * positions as f64)
    }
}

/// What one level of drafting (one token of a chain, `width` of a tree) costs the drafter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DraftCost {
    /// Prompt lookup: nothing worth counting.
    Free,
    /// A draft model not measured yet: counted as free, but at most two levels, which measure it.
    Unmeasured,
    /// A draft model's measured milliseconds per level.
    PerLevel(f64),
}

impl DraftCost {
    /// A draft model's cost from its measured milliseconds per level (0: not measured yet).
    pub fn of_model(ms_per_level: f64) -> Self {
        if ms_per_level > 0.0 {
            DraftCost::PerLevel(ms_per_level)
        } else {
            DraftCost::Unmeasured
        }
    }
}

/// The draft size in `min..=max` tokens that maximises tokens per millisecond for one sequence
/// riding a step with `rows` other positions that emit `others` tokens, for a draft of `width`
/// candidates per level (1: a chain): with `l` levels of `l × width` tokens,
/// `(others + E(l)) / (pass(rows + 1 + l × width) + l × draft_ms)`, `a` and `draft_ms` per level.
/// 0 (no draft) when no size beats it or the pass was never measured; an unmeasured draft model
/// drafts at most two levels (or `min`), which measure it.
pub fn choose_draft(
    a: f64,
    cost: &PassCost,
    (rows, others): (usize, f64),
    draft: DraftCost,
    (min, max): (usize, usize),
    width: usize,
) -> usize {
    let w = width.max(1);
    let draft_ms = match draft {
        DraftCost::PerLevel(ms) => ms,
        DraftCost::Free | DraftCost::Unmeasured => 0.0,
    };
    let Some(plain) = cost.predict(rows + 1) else { return 0 };
    let mut best = (0, (others + 1.0) / plain.max(1e-9));
    for l in min.div_ceil(w).max(1)..=max / w {
        let t = cost.predict(rows + 1 + l * w).unwrap_or(plain) + l as f64 * draft_ms;
        let rate = (others + expected_tokens(a, l)) / t.max(1e-9);
        if rate > best.1 {
            best = (l * w, rate);
        }
    }
    match draft {
        DraftCost::Unmeasured => best.0.min((2 * w).max(min)),
        _ => best.0,
    }
}

/// How many levels a draft verified with `parents` (empty: a chain of `drafted`) reached: what the
/// acceptance rate is per.
pub fn levels(parents: &[u32], drafted: usize) -> usize {
    depths(parents).into_iter().max().unwrap_or(drafted)
}

/// The drafted token after node `at` (0: the token before the draft; i: drafted token i − 1) that
/// is `token` — a chain's next token, or one of a tree's children — if any.
pub fn drafted_child(draft: &[u32], parents: &[u32], at: usize, token: u32) -> Option<usize> {
    (0..draft.len()).find(|&c| {
        let parent = if parents.is_empty() { c } else { parents[c] as usize };
        parent == at && draft[c] == token
    })
}

/// Each drafted token's depth in its tree (1: a child of the token before the draft).
fn depths(parents: &[u32]) -> Vec<usize> {
    let mut d = Vec::with_capacity(parents.len());
    for &p in parents {
        let depth = if p == 0 { 1 } else { d[p as usize - 1] + 1 };
        d.push(depth);
    }
    d
}

/// `parents` as the wire and the forward pass take them: empty when they are a chain.
pub fn tree_or_chain(parents: Vec<u32>) -> Vec<u32> {
    if parents.iter().enumerate().all(|(i, &p)| p as usize == i) {
        Vec::new()
    } else {
        parents
    }
}

/// Checks that `draft` can draft for `target` before either loads: the same vocabulary, token for
/// token (else the first id that differs is named), and fewer weight bytes than the target.
pub fn check_draft(
    target: &layerstream_model::Store,
    draft: &layerstream_model::Store,
) -> layerstream_model::Result<()> {
    let (t, d) = (target.tokenizer()?, draft.tokenizer()?);
    if let Some((id, a, b)) = t.first_difference(&d) {
        let show = |x: Option<String>| x.map_or("no token".to_string(), |s| format!("{s:?}"));
        return Err(layerstream_model::Error::Draft(format!(
            "{}: its vocabulary differs from the target's {} at id {id}: {} in the draft, {} in the target",
            draft.dir.display(),
            target.dir.display(),
            show(b),
            show(a)
        )));
    }
    let size = |s: &layerstream_model::Store| s.manifest.files.iter().map(|f| f.size).sum::<u64>();
    if size(draft) >= size(target) {
        return Err(layerstream_model::Error::Draft(format!(
            "{} ({} bytes) is not smaller than the target {} ({} bytes): drafting would cost more than it saves",
            draft.dir.display(),
            size(draft),
            target.dir.display(),
            size(target)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_proposes_what_followed_the_last_match() {
        // "1 2 3 4 5 … 1 2 3" → 4 5 follow the earlier "1 2 3".
        let h = [1, 2, 3, 4, 5, 9, 1, 2, 3];
        assert_eq!(ngram_propose(&h, 2), vec![4, 5]);
        assert_eq!(ngram_propose(&h, 10), vec![4, 5, 9, 1, 2, 3]);
        assert!(ngram_propose(&h, 0).is_empty());
        // The longest n-gram wins over a more recent shorter match: "7 2 3" later, "1 2 3" earlier.
        let h = [1, 2, 3, 8, 7, 2, 3, 6, 1, 2, 3];
        assert_eq!(ngram_propose(&h, 1), vec![8]);
        // Nothing repeats: no proposal (a single repeated token is below NGRAM_MIN).
        assert!(ngram_propose(&[1, 2, 3, 4, 1], 3).is_empty());
        // A short match at the end is passed over for an earlier one with a full continuation.
        let h = [5, 6, 1, 2, 3, 5, 6, 9, 5, 6];
        assert_eq!(ngram_propose(&h, 3), vec![9, 5, 6], "the most recent full continuation");
        assert_eq!(ngram_propose(&h, 4), vec![1, 2, 3, 5], "3 after the recent match, 4 earlier");
    }

    #[test]
    fn limits_are_checked_and_applied() {
        assert!(SpecLimits { n_max: Some(MAX_DRAFT), n_min: 2 }.validate().is_ok());
        let e = SpecLimits { n_max: Some(MAX_DRAFT + 1), n_min: 0 }.validate().unwrap_err();
        assert_eq!(e.field(), Field::SpecMax);
        let e = SpecLimits { n_max: Some(3), n_min: 4 }.validate().unwrap_err();
        assert_eq!(e.field(), Field::SpecMin);
        assert_eq!(SpecLimits { n_max: None, n_min: 0 }.max(8), 8);
        assert_eq!(SpecLimits { n_max: Some(0), n_min: 0 }.max(8), 0);
        assert_eq!(SpecLimits { n_max: Some(20), n_min: 0 }.max(8), 20);
        assert_eq!("ngram".parse::<SpecMode>().unwrap(), SpecMode::Ngram);
        assert!("tree".parse::<SpecMode>().unwrap_err().contains("off, auto"));
        assert_eq!(SpecMode::Auto.resolve(false).unwrap(), SpecMode::Ngram);
        assert!(SpecMode::Draft.resolve(false).is_err());
    }

    #[test]
    fn tree_depths_and_chains() {
        assert_eq!(depths(&[0, 0, 1, 2, 3]), vec![1, 1, 2, 2, 3]);
        assert_eq!((levels(&[0, 0, 1, 2, 3], 5), levels(&[], 4)), (3, 4));
        // Node 0 (token 7) is the root's child in a chain and in the tree; node 3's parent is node 1.
        assert_eq!(drafted_child(&[7, 8, 9, 6], &[], 0, 7), Some(0));
        assert_eq!(drafted_child(&[7, 8, 9, 6], &[], 1, 8), Some(1));
        assert_eq!(drafted_child(&[7, 8, 9, 6], &[0, 0, 1, 2], 2, 6), Some(3));
        assert_eq!(drafted_child(&[7, 8, 9, 6], &[0, 0, 1, 2], 1, 6), None);
        assert!(tree_or_chain(vec![0, 1, 2]).is_empty());
        assert_eq!(tree_or_chain(vec![0, 0, 1]), vec![0, 0, 1]);
    }

    #[test]
    fn acceptance_is_per_position_reached() {
        let mut a = Acceptance::default();
        a.record(4, 4); // all accepted: 4 tested
        a.record(4, 1); // one accepted, the second rejected: 2 tested
        assert_eq!((a.accepted, a.tested), (5, 6));
        assert!((expected_tokens(0.5, 2) - 1.75).abs() < 1e-12);
    }

    /// A flat (link-bound) pass drafts long; a pass whose cost grows with positions as fast as a
    /// whole pass per position drafts nothing; a measured curve in between picks in between.
    #[test]
    fn draft_size_follows_the_cost_of_a_pass() {
        let fit = |f: &dyn Fn(usize) -> f64| {
            let mut c = PassCost::default();
            for p in [1, 2, 4, 8, 16, 32, 64, 1, 8] {
                c.record(p, f(p));
            }
            c
        };
        let flat = fit(&|_| 100.0);
        assert!((flat.predict(40).unwrap() - 100.0).abs() < 1e-6);
        assert_eq!(choose_draft(0.8, &flat, (0, 0.0), DraftCost::Free, (0, 16), 1), 16);
        let linear = fit(&|p| 10.0 * p as f64);
        assert_eq!(choose_draft(0.8, &linear, (0, 0.0), DraftCost::Free, (0, 16), 1), 0);
        let mid = fit(&|p| 100.0 + 5.0 * p as f64);
        let k = choose_draft(0.7, &mid, (0, 0.0), DraftCost::Free, (0, 16), 1);
        assert!(k > 0 && k < 16, "{k}");
        // A draft model's own time per token shortens drafts.
        assert!(choose_draft(0.7, &mid, (0, 0.0), DraftCost::PerLevel(20.0), (0, 16), 1) < k);
        // Never measured: no draft; a minimum is respected when drafting pays at all.
        assert_eq!(
            choose_draft(0.9, &PassCost::default(), (0, 0.0), DraftCost::Free, (0, 8), 1),
            0
        );
        assert!(choose_draft(0.8, &flat, (0, 0.0), DraftCost::Free, (4, 8), 1) >= 4);
        // Trees: whole levels of `width` tokens; the draft's time counts once per level.
        let k = choose_draft(0.8, &flat, (0, 0.0), DraftCost::PerLevel(5.0), (0, 16), 3);
        assert!(k > 0 && k.is_multiple_of(3) && k <= 15, "{k}");
        assert_eq!(
            choose_draft(0.8, &flat, (0, 0.0), DraftCost::PerLevel(5.0), (0, 2), 3),
            0,
            "no whole level fits"
        );
        // A draft model not measured yet: two levels, which measure it.
        assert_eq!(choose_draft(0.8, &flat, (0, 0.0), DraftCost::Unmeasured, (0, 16), 3), 6);
    }
}
