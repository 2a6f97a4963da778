//! Batch invariance, probed as a user would through a running `up` on the real SmolLM2 Q4_1, on
//! the CPU's default path (8-bit activations) and on `--exact`: a seeded request gets the same
//! tokens alone and under a load that mixes its steps with other sequences' prefills (steps of
//! hundreds of rows); a request's `n` choices are the single requests with seed + i; a repeated
//! prompt whose prefix comes from the prefix cache gets what it got computed whole. On the default
//! path the log-probabilities are equal too (every row the same bits whatever its step holds);
//! `--exact` multiplies steps of 256 rows or more by GEMM, so there only the tokens are promised.
//! Before the many-row 8-bit kernel the default path took f32 past 8 rows and its log-probabilities
//! differed under load (issue #42).

use layerstream_tests::stack::*;
use layerstream_tests::*;

const PROMPTS: [&str; 3] = [
    "Write a short poem about the sea.",
    "Name three uses of a paperclip.",
    "What does a compiler do? Answer briefly.",
];

/// A long prompt: its prefill is a step of many rows.
const LONG: &str = "Summarize the following in one sentence: The loader daemon reads each layer \
    file from disk into shared memory before the workers need it, so the copy to the device \
    overlaps the compute of the previous layer; the coordinator plans which worker owns which \
    layers, batches every active sequence into one pass over the weights, and streams the tokens \
    back to the clients over gRPC and an OpenAI-compatible API while tracing every read.";

fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v["output_ids"].clone()).unwrap()
}

/// POSTs `body` to the stack's `/v1/completions`.
fn completion(http: &str, body: serde_json::Value) -> serde_json::Value {
    post_ok(http, "/v1/completions", &body)
}

/// A sampled completion of `prompt` with `n` choices from `seed`, each token's log-probability
/// and two alternatives returned: equal JSON means equal tokens and logits to the last bit of
/// their printed f32.
fn sampled(prompt: &str, n: u64, seed: u64, max_tokens: u64) -> serde_json::Value {
    serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "n": n,
        "temperature": 0.9, "top_p": 0.95, "seed": seed, "logprobs": 2})
}

#[test]
fn the_default_path_gives_the_same_tokens_and_logprobs_however_a_request_is_batched() {
    // The tests' commands default to `--exact` (`cmd`); the CPU's default path is the 8-bit one.
    through_a_stack("--int8-activations", true);
}

#[test]
fn the_exact_path_gives_the_same_tokens_however_a_request_is_batched() {
    through_a_stack("--exact", false);
}

/// The three cases through a one-worker stack on `path`; `logprobs`: compare the log-probabilities
/// too, not only the texts.
fn through_a_stack(path: &str, logprobs: bool) {
    let store = default_store().expect("the default model");
    let stack = Stack::up(&store, &["--workers", "1", "--served-model-name", "m", path]);
    let (addr, http) = (stack.addr().to_owned(), stack.http().to_owned());
    // The choices' texts and (`logprobs`) log-probabilities.
    let choices = |v: &serde_json::Value| -> Vec<(serde_json::Value, serde_json::Value)> {
        let cs = v["choices"].as_array().unwrap_or_else(|| panic!("no choices: {v}"));
        let lp = |c: &serde_json::Value| if logprobs { c["logprobs"].clone() } else { 0.into() };
        cs.iter().map(|c| (c["text"].clone(), lp(c))).collect()
    };
    let one = |i: usize| completion(&http, sampled(PROMPTS[i], 1, 11 + i as u64, 16));

    // Alone, one after another.
    let alone: Vec<_> = (0..PROMPTS.len()).map(|i| choices(&one(i))).collect();
    for c in alone.iter().filter(|_| logprobs) {
        let n = c[0].1["token_logprobs"].as_array().map_or(0, Vec::len);
        assert!(n > 0, "no log-probabilities returned: {c:?}");
    }
    // Under load: the same requests beside six long prompts, whose prefills share steps with
    // their decodes (steps of well over 8 rows).
    let loaded: Vec<_> = std::thread::scope(|s| {
        let load: Vec<_> = (0..6)
            .map(|i| {
                let addr = addr.clone();
                s.spawn(move || {
                    let n = (8 + i).to_string();
                    submit(&addr, &["--chat", LONG, "--max-new-tokens", &n])
                })
            })
            .collect();
        let mine: Vec<_> = (0..PROMPTS.len()).map(|i| s.spawn(move || choices(&one(i)))).collect();
        let out = mine.into_iter().map(|h| h.join().unwrap()).collect();
        for h in load {
            assert!(!ids(&h.join().unwrap()).is_empty());
        }
        out
    });
    for (i, (a, l)) in alone.iter().zip(&loaded).enumerate() {
        assert_eq!(a, l, "prompt {i}: tokens and log-probabilities alone vs under load");
    }

    // `n` = 12 choices of one request (12 sequences in each step) against single requests with
    // seed + i.
    let many = completion(&http, sampled(PROMPTS[0], 12, 40, 12));
    let cs = choices(&many);
    assert_eq!(cs.len(), 12, "{many}");
    let distinct: std::collections::BTreeSet<String> = cs.iter().map(|c| c.0.to_string()).collect();
    assert!(distinct.len() > 1, "12 seeds gave one text: {many}");
    for (i, c) in cs.iter().enumerate() {
        let single = choices(&completion(&http, sampled(PROMPTS[0], 1, 40 + i as u64, 12)));
        assert_eq!(c, &single[0], "choice {i} vs seed 40 + {i} alone");
    }

    // A repeated prompt: the second time its prefix comes from the cache and only the rest is
    // computed, in a step of fewer rows.
    let long = || completion(&http, sampled(LONG, 1, 5, 12));
    let (first, again) = (long(), long());
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 16, "the prefix cache served nothing: {again}");
    assert_eq!(choices(&first), choices(&again), "computed whole vs prefix-cached");
    stack.shutdown();
}

/// In process, on the default model's weights with 8-bit activations: a sequence's logits are the
/// same bits fed alone, fed in a step beside a 40-row prefill, and fed
/// after its prefix was computed in an earlier step (as the prefix cache leaves it).
#[test]
fn logits_do_not_depend_on_the_step() {
    use layerstream_kernels::CpuBackend;
    use layerstream_worker::Model;
    let store = layerstream_model::Store::open(&default_store().expect("the default model"))
        .expect("the default store opens");
    let model = Model::load(CpuBackend::default(), &store)
        .unwrap()
        .with_precision(layerstream_kernels::Precision::Int8);
    let ids: Vec<u32> = (0..9).map(|i| 100 + 37 * i).collect();
    let long: Vec<u32> = (0..40).map(|i| 200 + 13 * i).collect();
    let mut s = model.new_sequence();
    let alone = model.forward(&mut [(&ids[..], &mut s)]).unwrap().remove(0);
    let (mut a, mut b) = (model.new_sequence(), model.new_sequence());
    let both = model.forward(&mut [(&ids[..], &mut a), (&long[..], &mut b)]).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&alone), bits(&both[0]), "alone vs beside a 40-row prefill");
    let mut c = model.new_sequence();
    model.forward(&mut [(&ids[..5], &mut c)]).unwrap();
    let rest = model.forward(&mut [(&ids[5..], &mut c)]).unwrap().remove(0);
    assert_eq!(bits(&alone), bits(&rest), "whole vs after its first 5 positions");
}
