//! The cost side of `layerstream bench --speculative`: the time of a weight pass as it carries more
//! positions (the curve the draft sizer fits), the draft model's time per drafted level, and — for a
//! synthetic pair, whose random weights accept nothing — the tokens per second a given per-token
//! acceptance would give on those measured costs.

use crate::bench::{stack_args, BenchArgs};
use crate::up::{spawn_quiet, Children};
use anyhow::{bail, Context, Result};
use layerstream_rpc::v1::{generate_request, GenerateRequest, TokenIds};
use layerstream_serving::spec::expected_tokens;
use std::path::Path;

/// The time of one weight pass carrying `k` positions: a prompt of 16·k token ids prefilled in
/// chunks of k (`--max-step-tokens k`), its prefill time over its 16 steps.
fn pass_ms(
    model: &str,
    vocab: usize,
    k: usize,
    a: &BenchArgs,
    rt: &tokio::runtime::Runtime,
) -> Result<f64> {
    let mut extra = crate::bench_spec::plan_args(a);
    extra.extend(["--max-step-tokens".to_owned(), k.to_string()]);
    let mut children = Children(Vec::new());
    let one = BenchArgs { batch: 1, ..a.clone() };
    let addr = spawn_quiet(&mut children, "pass", &stack_args(model, &one, &extra))?.addr;
    let ids =
        |n: usize| -> Vec<u32> { (0..n).map(|i| (1 + (i * 7919) % (vocab - 1)) as u32).collect() };
    let req = |n: usize| GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids: ids(n) })),
        max_new_tokens: 1,
        ..Default::default()
    };
    rt.block_on(crate::bench_spec::send(&addr, req(k), 1))?;
    let (_, stats, _) = rt.block_on(crate::bench_spec::send(&addr, req(16 * k), 1))?;
    let st = &stats[0];
    Ok(st.first_token_ms / st.steps.max(1) as f64)
}

/// The pass time at each of `--pass-positions`, printed as a table; returns (positions, ms).
pub(crate) fn pass_curve(
    model: &str,
    vocab: usize,
    a: &BenchArgs,
    rt: &tokio::runtime::Runtime,
) -> Result<Vec<(usize, f64)>> {
    let mut ks = a.pass_positions.clone();
    ks.sort_unstable();
    ks.dedup();
    if ks.first().is_none_or(|&k| k == 0) {
        bail!("--pass-positions must be positive counts of positions, got {:?}", a.pass_positions);
    }
    println!("\n| positions per pass | pass ms | ÷ {} position(s) |\n|---|---|---|", ks[0]);
    let mut curve = Vec::with_capacity(ks.len());
    for k in ks {
        let ms = pass_ms(model, vocab, k, a, rt).with_context(|| format!("pass of {k}"))?;
        let base = curve.first().map_or(ms, |&(_, b)| b);
        println!("| {k} | {ms:.1} | {:.2} |", ms / base);
        curve.push((k, ms));
    }
    Ok(curve)
}

/// Milliseconds of one drafted level (one token's forward pass) of the draft model alone on the
/// bench's device: `layerstream run` decoding 32 tokens after a 4-token prompt, resident.
pub(crate) fn draft_level_ms(draft: &Path, a: &BenchArgs) -> Result<f64> {
    let exe = std::env::current_exe().context("locating the layerstream binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["run", "--model"]).arg(draft);
    cmd.args(["--token-ids", "1,2,3,4", "--max-new-tokens", "33", "--ignore-eos", "--json"]);
    cmd.args(["--device", &a.device.compute.device]);
    if let Some(t) = a.device.compute.threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    let out = cmd.stderr(std::process::Stdio::inherit()).output().context("running the draft")?;
    if !out.status.success() {
        bail!("timing the draft model {}: `layerstream run` failed", draft.display());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or_default();
    let v: serde_json::Value =
        serde_json::from_str(last).context("reading `layerstream run --json`")?;
    let tok_s = v["timings"]["decode_tok_s"].as_f64().unwrap_or(0.0);
    if tok_s <= 0.0 {
        bail!("the draft model's decode rate was not measured: {last}");
    }
    Ok(1e3 / tok_s)
}

/// The pass time at `k` positions from the measured curve: linear between measured points, the
/// last segment's slope past the end, the first point's time below it.
pub(crate) fn interpolate(curve: &[(usize, f64)], k: usize) -> f64 {
    let Some(&(k0, ms0)) = curve.first() else { return 0.0 };
    if k <= k0 || curve.len() == 1 {
        return ms0;
    }
    let i = curve.iter().position(|&(x, _)| x >= k).unwrap_or(curve.len() - 1).max(1);
    let ((xa, ya), (xb, yb)) = (curve[i - 1], curve[i]);
    ya + (yb - ya) * (k as f64 - xa as f64) / (xb as f64 - xa as f64)
}

/// A projection at one acceptance rate: the chain length that maximises tokens per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Projection {
    pub(crate) acceptance: f64,
    pub(crate) draft: usize,
    pub(crate) tokens_per_pass: f64,
    pub(crate) tok_s: f64,
    pub(crate) over_plain: f64,
}

/// The best chain of at most `max` drafted tokens at per-token acceptance `a`: each step is a pass
/// of k + 1 positions after k drafted levels of `level_ms`, and emits 1 + a + … + a^k tokens.
pub(crate) fn project(curve: &[(usize, f64)], level_ms: f64, a: f64, max: usize) -> Projection {
    let plain = interpolate(curve, 1);
    let rate = |k: usize| {
        let ms = interpolate(curve, k + 1) + k as f64 * level_ms;
        1e3 * expected_tokens(a, k) / ms.max(1e-9)
    };
    let k = (0..=max).max_by(|&x, &y| rate(x).total_cmp(&rate(y))).unwrap_or(0);
    Projection {
        acceptance: a,
        draft: k,
        tokens_per_pass: expected_tokens(a, k),
        tok_s: rate(k),
        over_plain: rate(k) * plain.max(1e-9) / 1e3,
    }
}

/// Prints the projections at `--acceptance` for the measured pass curve and draft cost.
pub(crate) fn print_projections(a: &BenchArgs, curve: &[(usize, f64)], level_ms: f64) {
    println!(
        "\nProjected at a per-token acceptance (a synthetic draft accepts nothing; the rates come \
         from a real pair): passes as measured above, {level_ms:.2} ms per drafted level"
    );
    println!(
        "\n| acceptance | best chain | tokens/pass | tok/s | ÷ plain |\n|---|---|---|---|---|"
    );
    for &acc in &a.acceptance {
        let p = project(curve, level_ms, acc, a.spec_max as usize);
        println!(
            "| {:.2} | {} | {:.2} | {:.1} | {:.2} |",
            p.acceptance, p.draft, p.tokens_per_pass, p.tok_s, p.over_plain
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolation_is_linear_between_points_and_extends_the_last_slope() {
        let c = [(1, 70.0), (16, 71.5), (64, 199.5)];
        assert_eq!(interpolate(&c, 1), 70.0);
        assert!((interpolate(&c, 6) - 70.5).abs() < 1e-9);
        assert!((interpolate(&c, 40) - 135.5).abs() < 1e-9);
        assert!((interpolate(&c, 128) - 370.166_666).abs() < 1e-3);
        assert_eq!(interpolate(&[(4, 9.0)], 1), 9.0);
    }

    #[test]
    fn projection_drafts_long_when_passes_are_flat_and_not_when_drafting_costs_more() {
        // A link-bound pass: 16 positions cost what one does.
        let flat = [(1, 100.0), (16, 101.0), (64, 300.0)];
        let p = project(&flat, 1.0, 0.8, 16);
        assert!(p.draft >= 8, "{p:?}");
        assert!(p.over_plain > 3.0 && p.tokens_per_pass > 4.0, "{p:?}");
        // Nothing accepted: no draft.
        assert_eq!(project(&flat, 1.0, 0.0, 16).draft, 0);
        // A draft level as slow as a pass never pays at a low acceptance.
        let p = project(&flat, 100.0, 0.3, 16);
        assert_eq!((p.draft, p.over_plain), (0, 1.0));
    }
}
