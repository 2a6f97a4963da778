//! Speculative decoding as users run it: `layerstream run` and a 2-worker `up` with prompt lookup
//! (`--spec ngram`) and a draft model (chains and token trees) give the same greedy and seeded tokens
//! as without speculation
//! on the real SmolLM2 (on the exact f32 path and on the CPU's default 8-bit one), while drafting and
//! accepting tokens (stats, Prometheus); bad drafts and bad
//! limits are refused naming what is wrong; and over 2,000 seeded draws the sampled tokens follow
//! the plain sampler's distribution (chi-square).

use layerstream_kernels::CpuBackend;
use layerstream_serving::spec::SpecMode;
use layerstream_serving::{GenerateParams, SamplingParams};
use layerstream_tests::stack::*;
use layerstream_tests::*;
use layerstream_worker::{generate, Model, Speculation};
use std::collections::BTreeMap;
use std::path::Path;

/// A code edit (prompt lookup's home ground: the answer copies the prompt), a chat answer, a summary.
const PROMPTS: [&str; 3] = [
    "Rewrite this function, renaming total to result:\n\ndef add_all(items):\n    total = 0\n    for item in items:\n        total = total + item\n    return total",
    "What is the capital of France? Answer in two sentences.",
    "Summarize in one sentence: The loader daemon reads each layer file from disk into shared memory before the workers need it, so the copy to the GPU overlaps the compute of the previous layer.",
];

fn run_json(store: &Path, prompt: &str, extra: &[&str]) -> serde_json::Value {
    let mut a = vec!["run", "--model", store.to_str().unwrap(), "--chat", prompt, "--json"];
    a.extend_from_slice(&["--max-new-tokens", "48"]);
    a.extend_from_slice(extra);
    last_json(&layerstream(&a))
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v["output_ids"].clone()).unwrap()
}

const SAMPLED: [&str; 6] = ["--temperature", "0.8", "--top-p", "0.95", "--seed", "7"];

/// `run` with prompt lookup and with a draft model: the same tokens as `--spec off`, greedy and
/// seeded, while drafts are made and accepted within `--spec-max`.
#[test]
fn run_speculates_without_changing_the_tokens() {
    let store = default_store().expect("the default model");
    let dir = tempfile::tempdir().unwrap();
    // tiny-llama carries SmolLM2's tokenizer: a (poor) draft with the same vocabulary.
    let draft = tiny_store(dir.path());
    let draft_flag = ["--spec", "draft", "--draft-model", draft.to_str().unwrap()];
    let tree_flag = [&draft_flag[..], &["--spec-width", "3"]].concat();
    let (mut drafted, mut accepted) = (0, 0);
    for prompt in PROMPTS {
        for sampling in [&[][..], &SAMPLED[..]] {
            let plain = run_json(&store, prompt, sampling);
            for spec in [&["--spec", "ngram", "--spec-max", "6"][..], &draft_flag[..], &tree_flag] {
                let got = run_json(&store, prompt, &[sampling, spec].concat());
                assert_eq!(ids(&got), ids(&plain), "{prompt:?} {sampling:?} {spec:?}");
                let t = &got["timings"];
                let d = t["spec_drafted"].as_u64().unwrap();
                let passes = t["weight_passes"].as_u64().unwrap();
                if spec.contains(&"6") {
                    assert!(d <= 6 * passes, "{d} drafted in {passes} passes");
                    drafted += d;
                    accepted += t["spec_accepted"].as_u64().unwrap();
                } else {
                    assert!(d > 0, "the draft model drafted nothing: {t}");
                }
                let n = ids(&got).len() as f64;
                let tpp = t["tokens_per_pass"].as_f64().unwrap();
                assert!((tpp - n / passes as f64).abs() < 1e-9, "{t}");
            }
        }
    }
    assert!(accepted > 0 && drafted >= accepted, "prompt lookup: {accepted} of {drafted} accepted");
}

/// On the CPU's default 8-bit path (`--int8-activations`, which the harness's `--exact` yields
/// to) the greedy tokens are the same with and without speculation: a decode step's drafted rows
/// take the path its plain decode takes, and a row's 8-bit product is the same bits alone or
/// batched.
#[test]
fn the_8_bit_path_speculates_without_changing_the_tokens() {
    let store = default_store().expect("the default model");
    let dir = tempfile::tempdir().unwrap();
    let draft = tiny_store(dir.path());
    let d = draft.to_str().unwrap();
    for prompt in PROMPTS {
        let plain = run_json(&store, prompt, &["--int8-activations"]);
        for spec in [
            &["--spec", "ngram", "--spec-max", "8"][..],
            &["--spec", "draft", "--draft-model", d],
            &["--spec", "draft", "--draft-model", d, "--spec-width", "2"],
        ] {
            let got = run_json(&store, prompt, &[&["--int8-activations"][..], spec].concat());
            assert_eq!(ids(&got), ids(&plain), "{prompt:?} {spec:?}");
        }
    }
}

/// Drafts that cannot work and limits out of range are refused before anything loads, naming why.
#[test]
fn bad_drafts_and_limits_are_refused() {
    let store = default_store().expect("the default model");
    let dir = tempfile::tempdir().unwrap();
    let tiny = tiny_store(dir.path());
    let gemma = import(&model_dir("tiny-gemma3"), &dir.path().join("g")).dir;
    let s = store.to_str().unwrap();
    let base = ["run", "--model", s, "--prompt", "Hi", "--max-new-tokens", "2"];
    let with = |extra: &[&str]| layerstream_fails(&[&base[..], extra].concat());
    let e = with(&["--spec", "draft", "--draft-model", gemma.to_str().unwrap()]);
    assert!(e.contains("vocabulary differs") && e.contains("at id"), "{e}");
    let e = layerstream_fails(&[
        "run",
        "--model",
        tiny.to_str().unwrap(),
        "--prompt",
        "Hi",
        "--spec",
        "draft",
        "--draft-model",
        s,
    ]);
    assert!(e.contains("is not smaller than the target"), "{e}");
    // A draft that does not fit beside the head's layers: refused by the planner, before loading.
    let e = layerstream_fails(&[
        "up",
        "--model",
        s,
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "off",
        "--memory-budget",
        "8M",
        "--spec",
        "draft",
        "--draft-model",
        tiny.to_str().unwrap(),
        "--prompt",
        "Hi",
    ]);
    assert!(e.contains("the draft model needs") && e.contains("memory budget"), "{e}");
    let e = with(&["--spec", "draft"]);
    assert!(e.contains("--spec draft needs --draft-model"), "{e}");
    let e = with(&["--spec", "ngram", "--draft-max", "65"]);
    assert!(e.contains("speculative.max_tokens: must be at most 64"), "{e}");
    let e = with(&["--spec", "ngram", "--spec-max", "65"]);
    assert!(e.contains("--spec-max"), "{e}");
}

/// Through a 2-worker `up` with a streamed layer, prompt lookup gives every request its `run`
/// tokens, alone and batched with the others (greedy and seeded); the stats, the metrics and the
/// page's API show drafts accepted; a request's limit past 64 is INVALID_ARGUMENT (gRPC) and a 400
/// naming `speculative.n_max` (OpenAI).
#[test]
fn a_pipeline_speculates_alone_and_batched_with_the_same_tokens() {
    let store = default_store().expect("the default model");
    let want: Vec<Vec<u32>> = PROMPTS
        .iter()
        .flat_map(|p| [ids(&run_json(&store, p, &[])), ids(&run_json(&store, p, &SAMPLED))])
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let tiny = tiny_store(dir.path());
    let base = ["--workers", "2", "--resident-layers", "13", "--spec-max", "8"];
    let tree = ["--spec", "draft", "--draft-model", tiny.to_str().unwrap(), "--spec-width", "2"];
    // Prompt lookup last: its stack (whose drafts the real model accepts; the random-weight draft's
    // are rarely accepted) stays up for the checks after.
    let mut stack = None;
    for spec in [&tree[..], &["--spec", "ngram"][..]] {
        if let Some(s) = stack.take() {
            Stack::shutdown(s);
        }
        let st = Stack::up(&store, &[&base[..], spec].concat());
        let addr = st.addr().to_owned();
        let job = |i: usize| {
            let mut a = vec!["--chat", PROMPTS[i / 2], "--max-new-tokens", "48"];
            if i % 2 == 1 {
                a.extend_from_slice(&SAMPLED);
            }
            submit(&addr, &a)
        };
        // Alone, one after another.
        let mut drafted = 0;
        for (i, w) in want.iter().enumerate() {
            let v = job(i);
            assert_eq!(&ids(&v), w, "request {i} alone ({spec:?})");
            drafted += v["stats"]["spec_drafted"].as_u64().unwrap();
            let passes = v["stats"]["weight_passes"].as_u64().unwrap();
            assert!(passes <= w.len() as u64, "{passes} passes for {} tokens", w.len());
        }
        assert!(drafted > 0, "nothing was drafted ({spec:?})");
        // All at once: plain and speculating sequences share steps.
        let got: Vec<serde_json::Value> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..want.len()).map(|i| s.spawn(move || job(i))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (v, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(&ids(v), w, "request {i} batched ({spec:?})");
        }
        stack = Some(st);
    }
    let stack = stack.expect("a stack ran");
    let addr = stack.addr().to_owned();
    let (d, a) = (
        stack.metric("layerstream_spec_drafted_tokens_total"),
        stack.metric("layerstream_spec_accepted_tokens_total"),
    );
    assert!(d > 0.0 && a > 0.0 && a <= d, "metrics: {a} accepted of {d}");
    let page = std::process::Command::new("curl")
        .args(["-sf", &format!("{}/api/stack", stack.http())])
        .output()
        .unwrap();
    let page: serde_json::Value = serde_json::from_slice(&page.stdout).unwrap();
    assert_eq!(page["spec"]["drafted"].as_f64().unwrap(), d);
    // A limit past 64: refused at the door.
    let out = cmd()
        .args(["submit", "--addr", &addr, "--prompt", "Hi", "--draft-max", "65"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("speculative.max_tokens"), "{e}");
    let name = store.file_name().unwrap().to_str().unwrap();
    let body = format!(
        r#"{{"model":"{name}","messages":[{{"role":"user","content":"Hi"}}],"speculative":{{"n_max":100}}}}"#
    );
    let out = std::process::Command::new("curl")
        .args(["-s", "-H", "content-type: application/json", "-d", &body])
        .arg(format!("{}/v1/chat/completions", stack.http()))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["param"], "speculative.n_max", "{v}");
    stack.shutdown();
}

/// The p-value of a chi-square statistic with `df` degrees of freedom (regularised upper incomplete
/// gamma, by its series and continued fraction).
fn chi2_p(x: f64, df: usize) -> f64 {
    let a = df as f64 / 2.0;
    let x = x / 2.0;
    if x <= 0.0 {
        return 1.0;
    }
    let ln_gamma = |z: f64| {
        // Lanczos (g = 7, n = 9).
        let c = [
            0.999_999_999_999_809_9,
            676.520_368_121_885_1,
            -1_259.139_216_722_402_8,
            771.323_428_777_653_1,
            -176.615_029_162_140_6,
            12.507_343_278_686_905,
            -0.138_571_095_265_720_12,
            9.984_369_578_019_572e-6,
            1.505_632_735_149_311_6e-7,
        ];
        let z = z - 1.0;
        let t = z + 7.5;
        let s: f64 = c[0] + (1..9).map(|i| c[i] / (z + i as f64)).sum::<f64>();
        0.5 * (2.0 * std::f64::consts::PI).ln() + (z + 0.5) * t.ln() - t + s.ln()
    };
    let front = (-x + a * x.ln() - ln_gamma(a)).exp();
    if x < a + 1.0 {
        let (mut sum, mut term, mut n) = (1.0 / a, 1.0 / a, a);
        for _ in 0..500 {
            n += 1.0;
            term *= x / n;
            sum += term;
        }
        1.0 - front * sum
    } else {
        // Lentz's continued fraction for Q(a, x).
        let tiny = 1e-300;
        let (mut b, mut c, mut d) = (x + 1.0 - a, 1.0 / tiny, 1.0 / (x + 1.0 - a));
        let mut h = d;
        for i in 1..500 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            d = if d.abs() < tiny { tiny } else { d };
            c = b + an / c;
            c = if c.abs() < tiny { tiny } else { c };
            d = 1.0 / d;
            h *= d * c;
        }
        front * h
    }
}

/// Over 2,000 seeds, the 6th sampled token (after five steps that could each accept drafts) has
/// the same distribution with prompt lookup and with a draft model as without speculation:
/// chi-square p > 0.01 on tiny-llama at temperature 1, top-k 6; the drafts were accepted often.
#[test]
fn sampled_tokens_follow_the_plain_distribution() {
    let dir = tempfile::tempdir().unwrap();
    let store = layerstream_model::Store::open(&tiny_store(dir.path())).unwrap();
    let model = Model::load(CpuBackend::default(), &store).unwrap();
    let tok = store.tokenizer().unwrap();
    let input = tok.encode("the cat sat on the mat and the cat").unwrap();
    let seeds = 2000;
    let counts = |spec: &Speculation<'_, CpuBackend>| -> (BTreeMap<u32, f64>, usize, usize) {
        let (mut c, mut drafted, mut accepted) = (BTreeMap::new(), 0, 0);
        for seed in 0..seeds {
            let p = GenerateParams {
                max_new_tokens: 6,
                ignore_eos: true,
                sampling: SamplingParams { temperature: 1.0, top_k: 6, seed, ..Default::default() },
                ..Default::default()
            };
            let g = generate(&model, &tok, &input, &p, spec, |_| {}).unwrap();
            *c.entry(g.output_ids[5]).or_insert(0.0) += 1.0;
            (drafted, accepted) =
                (drafted + g.timings.spec_drafted, accepted + g.timings.spec_accepted);
        }
        (c, drafted, accepted)
    };
    let (plain, _, _) = counts(&Speculation::off());
    for (name, spec) in [
        ("ngram", Speculation { mode: SpecMode::Ngram, max: 4, draft: None, width: 1 }),
        // The target drafting for itself: its greedy tokens, accepted where sampling agrees.
        ("draft", Speculation { mode: SpecMode::Draft, max: 4, draft: Some(&model), width: 1 }),
        ("tree", Speculation { mode: SpecMode::Draft, max: 6, draft: Some(&model), width: 3 }),
    ] {
        let (got, drafted, accepted) = counts(&spec);
        let keys: std::collections::BTreeSet<u32> =
            plain.keys().chain(got.keys()).copied().collect();
        // Two-sample chi-square over the tokens seen (equal sample sizes).
        let stat: f64 = keys
            .iter()
            .map(|k| {
                let (a, b) =
                    (plain.get(k).copied().unwrap_or(0.0), got.get(k).copied().unwrap_or(0.0));
                (a - b).powi(2) / (a + b)
            })
            .sum();
        let p = chi2_p(stat, keys.len() - 1);
        assert!(p > 0.01, "{name}: chi-square {stat:.2}, p = {p:.4} ({plain:?} vs {got:?})");
        assert!(accepted > 0 && drafted > accepted, "{name}: {accepted} of {drafted} accepted");
    }
    // The p-value itself: chi-square 11.07 with 5 degrees of freedom is p = 0.05.
    assert!((chi2_p(11.0705, 5) - 0.05).abs() < 1e-3);
    assert!((chi2_p(3.0, 4) - 0.5578).abs() < 1e-3);
}

/// `bench --speculative --acceptance` on a synthetic pair (random weights, which accept nothing):
/// it times passes of each `--pass-positions` and a draft token, then projects tokens/s per rate —
/// never lower at a higher rate on the same costs; rates outside [0, 1) and a missing draft model
/// are refused naming the flag.
#[test]
fn bench_projects_a_synthetic_pair_at_given_acceptance_rates() {
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = (dir.path().join("t"), dir.path().join("d"));
    let (t, d) = (t.to_str().unwrap(), d.to_str().unwrap());
    layerstream(&["synth", "--shape", "tiny", "--dtype", "q4_k", "--layers", "4", t]);
    layerstream(&["synth", "--shape", "tiny", "--dtype", "q4_k", "--layers", "1", d]);
    let base = ["bench", "--speculative", "--model", t, "--batch", "1", "--resident-layers", "0"];
    let out = layerstream(
        &[&base[..], &["--draft-model", d, "--pass-positions", "1,4", "--acceptance", "0.6,0.9"]]
            .concat(),
    );
    let rows: Vec<Vec<f64>> = out
        .lines()
        .filter(|l| l.starts_with("| 0."))
        .map(|l| l.split('|').filter_map(|c| c.trim().parse().ok()).collect())
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(out.contains("| 1 |") && out.contains("| 4 |"), "the pass times: {out}");
    // | acceptance | best chain | tokens/pass | tok/s | ÷ plain |
    assert_eq!((rows[0][0], rows[1][0]), (0.6, 0.9), "{out}");
    assert!(rows.iter().all(|r| r.len() == 5 && r[2] >= 1.0 && r[4] >= 1.0), "{out}");
    assert!(rows[1][3] >= rows[0][3], "a higher rate projected slower: {out}");
    let e = layerstream_fails(&[&base[..], &["--draft-model", d, "--acceptance", "1.5"]].concat());
    assert!(e.contains("--acceptance takes rates in [0, 1), got 1.5"), "{e}");
    let e = layerstream_fails(&[&base[..], &["--acceptance", "0.5"]].concat());
    assert!(e.contains("give --draft-model"), "{e}");
}

/// A draft tree grown over two passes (`Model::forward_grow`: the second pass's rows see the
/// cached history and their own ancestors among the first pass's rows) gives every node the
/// logits of its path fed causally on its own, on a real (tiny) model; a mask that does not name
/// its own row is refused.
#[test]
fn a_tree_grown_over_two_passes_gives_each_node_its_paths_logits() {
    let dir = tempfile::tempdir().unwrap();
    let store = layerstream_model::Store::open(&tiny_store(dir.path())).unwrap();
    let model = Model::load(CpuBackend::default(), &store).unwrap();
    let history = [1u32, 17, 305, 42];
    // Nodes: 0 and 1 children of the root (the last history token); 2 and 3 children of node 0,
    // 4 a child of node 1; 5 a child of node 3. Passes: nodes 0-1, then 2-4, then 5.
    let (tokens, parents) = ([7u32, 9, 11, 13, 15, 19], [0u32, 0, 1, 1, 2, 4]);
    let mut masks = vec![0u64; tokens.len()];
    for i in 0..tokens.len() {
        let p = parents[i] as usize;
        masks[i] = (if p == 0 { 0 } else { masks[p - 1] }) | 1 << i;
    }
    let mut seq = model.new_sequence();
    model.forward(&mut [(&history[..], &mut seq)]).unwrap();
    let mut got = Vec::new();
    for (from, to) in [(0, 2), (2, 5), (5, 6)] {
        let rows = model.forward_grow(&tokens[from..to], &mut seq, masks[from..to].to_vec(), from);
        got.extend(rows.unwrap());
    }
    assert_eq!(got.len(), tokens.len());
    for (i, logits) in got.iter().enumerate() {
        let mut path = vec![i];
        while parents[*path.last().unwrap()] != 0 {
            let p = parents[*path.last().unwrap()] as usize - 1;
            path.push(p);
        }
        let ids: Vec<u32> =
            history.iter().copied().chain(path.iter().rev().map(|&n| tokens[n])).collect();
        let want = prefill_logits(&model, &ids);
        let d = max_abs_diff(logits, &want);
        assert!(d < 1e-4, "node {i} (path {path:?}): {d}");
    }
    // A mask that does not name the node itself is refused, naming the tree.
    let e = model.forward_grow(&[3], &mut seq, vec![0b1], 6).unwrap_err().to_string();
    assert!(e.contains("token tree"), "{e}");
}
