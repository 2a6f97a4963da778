//! `layerstream perplexity` against an independent computation of the same number: the command
//! scores each window's second half from one pass over all its rows; here the same windows are fed
//! one token at a time through the decode path, each next-token log-likelihood taken from that
//! step's logits, and the perplexity computed from those.

use layerstream_kernels::CpuBackend;
use layerstream_model::Store;
use layerstream_tests::*;
use layerstream_worker::Model;

/// Negative log-likelihood of `next` under `logits` (natural log), computed here on its own.
fn nll(logits: &[f32], next: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let lse = max + logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    lse - logits[next as usize] as f64
}

#[test]
fn perplexity_equals_a_token_by_token_computation() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let text_path = dir.path().join("text.txt");
    let text = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. ".repeat(4);
    std::fs::write(&text_path, &text).unwrap();
    let ctx = 16;
    // `layerstream perplexity` on the store, with `file` and these arguments.
    let args = |file: &std::path::Path, extra: &[&str]| {
        let mut a = vec!["perplexity", "--model", store.to_str().unwrap()];
        a.extend(["--file", file.to_str().unwrap()]);
        a.extend_from_slice(extra);
        a.iter().map(|x| x.to_string()).collect::<Vec<String>>()
    };
    let run = |extra: &[&str]| {
        let a = args(&text_path, extra);
        last_json(&layerstream(&a.iter().map(String::as_str).collect::<Vec<_>>()))
    };
    let v = run(&["--ctx", "16", "--json"]);
    // Independently: whole windows of the tokenized text, scored token by token from ctx/2 on.
    let s = Store::open(&store).unwrap();
    let tokens = s.tokenizer().unwrap().encode(&text).unwrap();
    let model = Model::load(CpuBackend::default(), &s).unwrap();
    let mut nlls = Vec::new();
    for w in tokens.chunks_exact(ctx) {
        let mut seq = model.new_sequence();
        let first = ctx / 2;
        let mut logits = model.forward(&mut [(&w[..=first], &mut seq)]).unwrap().remove(0);
        for i in first..ctx - 1 {
            nlls.push(nll(&logits, w[i + 1]));
            if i + 1 < ctx - 1 {
                logits = model.forward(&mut [(&w[i + 1..i + 2], &mut seq)]).unwrap().remove(0);
            }
        }
    }
    let want = (nlls.iter().sum::<f64>() / nlls.len() as f64).exp();
    let got = v["ppl"].as_f64().unwrap();
    assert_eq!(v["scored"].as_u64().unwrap() as usize, nlls.len(), "{v}");
    assert_eq!(v["windows"].as_u64().unwrap() as usize, tokens.len() / ctx);
    assert!((got - want).abs() / want < 1e-4, "perplexity {got}, token by token {want}");
    assert!(v["stderr"].as_f64().unwrap() > 0.0);
    // --decode scores the same tokens through one-row steps: the same number.
    let d = run(&["--ctx", "16", "--json", "--decode"]);
    assert_eq!(d["scored"], v["scored"]);
    let dp = d["ppl"].as_f64().unwrap();
    assert!((dp - want).abs() / want < 1e-4, "decode-path perplexity {dp}, token by token {want}");
    // A text shorter than one window, and a window larger than the context, are refused.
    let fails = |file: &std::path::Path, extra: &[&str]| {
        let a = args(file, extra);
        layerstream_fails(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "Hi.").unwrap();
    let err = fails(&short, &["--ctx", "16"]);
    assert!(err.contains("fewer than one window of --ctx 16"), "{err}");
    let err = fails(&text_path, &["--ctx", "100000"]);
    assert!(err.contains("exceeds the model's context"), "{err}");
}
