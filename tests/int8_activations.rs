//! `--int8-activations` numerics against transformers: the file types it computes in integers
//! (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K: their files and the K-quant mixes
//! Q2_K, Q3_K_M, Q4_K_M and Q5_K_M), each prompt fed one token per step (so every
//! matmul takes the 8-bit path), last-position logits against transformers' on the weights gguf-py
//! dequantizes from the same file. 8-bit activations round each 32-value block to 1/254 of its
//! largest value, so the logits move by a bounded fraction of their spread, not to the f32 path's
//! `LOGIT_TOL`; the f32 path is checked against the same references in tests/quant_models.rs.
//! Its own test binary: the switch is process-wide.

use layerstream_kernels::CpuBackend;
use layerstream_kernels::Precision::Int8;
use layerstream_tests::*;
use layerstream_worker::{Model, SeqState};

/// Largest logit error allowed, as a fraction of the reference logits' range (measured: 0.8-1.9%
/// over these 21 prompts and file types; a wrong scale or offset term is tens of percent).
const REL_TOL: f32 = 0.03;

#[test]
fn int8_logits_stay_within_three_percent_of_the_logit_range_of_transformers() {
    for t in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K"]
    {
        let dir = tempfile::tempdir().unwrap();
        let gguf = fixtures().join("gguf").join("quant").join(format!("tiny-llama-{t}.gguf"));
        let store = import(&gguf, dir.path());
        let model = Model::load(CpuBackend::default(), &store).unwrap().with_precision(Int8);
        let name = format!("tiny-llama-quant/{t}");
        for g in goldens(&name) {
            let mut seq: SeqState = model.new_sequence();
            let mut logits = vec![];
            for id in &g.input_ids {
                logits = model.forward(&mut [(&[*id][..], &mut seq)]).unwrap().remove(0);
            }
            let want = reference_logits(&name, &g.name);
            let range = want.iter().fold(f32::MIN, |a, &b| a.max(b))
                - want.iter().fold(f32::MAX, |a, &b| a.min(b));
            let d = max_abs_diff(&logits, &want);
            println!("{name}/{}: max |int8 - transformers| {d:.4} of a {range:.2} range", g.name);
            assert!(d <= REL_TOL * range, "{name}/{}: {d} > {REL_TOL} x {range}", g.name);
            // And not the f32 result: the 8-bit path really ran.
            assert!(d > LOGIT_TOL, "{name}/{}: int8 logits equal f32's ({d})", g.name);
        }
    }
}
