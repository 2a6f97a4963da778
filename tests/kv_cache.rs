//! The paged KV cache as users run it: a 2-worker streamed `up` gives the same greedy tokens with
//! the prefix cache on and off (alone and batched) while a repeated prompt starts after its cached
//! blocks (gRPC stats, OpenAI `usage.prompt_tokens_details.cached_tokens`, Prometheus); a pool too
//! small for every sequence at once preempts them — to the host-RAM tier and back, or replayed
//! without one — with each one's solo tokens; every
//! KV dtype runs, an f16 cache keeps transformers' greedy tokens up to the first near-tie, and bad
//! KV flags are refused naming what is wrong.

use layerstream_tests::stack::*;
use layerstream_tests::*;
use std::path::Path;

/// A prompt of 40+ tokens (a few KV blocks of 16), asked in chat form.
const LONG: &str =
    "The loader daemon reads each layer file from disk into shared memory before the \
    workers need it, so the copy to the device overlaps the compute of the previous layer. Explain \
    what happens when the disk is slower than the link.";

fn ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    serde_json::from_value(v[key].clone()).unwrap()
}

fn stat(v: &serde_json::Value, key: &str) -> u64 {
    v["stats"][key].as_u64().unwrap_or_else(|| panic!("stats.{key} in {v}"))
}

/// The OpenAI chat endpoint through curl: the response's JSON.
fn openai_chat(stack: &Stack, text: &str) -> serde_json::Value {
    let body = serde_json::json!({"model": "m", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": text}]});
    post_ok(stack.http(), "/v1/chat/completions", &body)
}

fn tiny(dir: &Path) -> std::path::PathBuf {
    import(&model_dir("tiny-llama"), dir).dir
}

#[test]
fn prefix_cache_keeps_the_tokens_and_skips_the_cached_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny(dir.path());
    let base = ["--workers", "2", "--resident-layers", "0", "--served-model-name", "m"];
    let mut outputs = Vec::new();
    for cache in [true, false] {
        let extra: Vec<&str> =
            if cache { base.to_vec() } else { [&base[..], &["--no-prefix-cache"]].concat() };
        let stack = Stack::up(&store, &extra);
        let job = || submit(stack.addr(), &["--chat", LONG, "--max-new-tokens", "12"]);
        let (first, again) = (job(), job());
        assert_eq!(ids(&first, "output_ids"), ids(&again, "output_ids"));
        assert_eq!(stat(&first, "cached_tokens"), 0);
        let prompt = stat(&again, "prompt_tokens");
        let cached = stat(&again, "cached_tokens");
        if cache {
            // Whole blocks of 16, never the last prompt token.
            assert!(cached >= 16 && cached.is_multiple_of(16) && cached < prompt, "{again}");
            assert!(stat(&again, "steps") <= stat(&first, "steps"));
            assert!(stack.metric("layerstream_prefix_cache_hit_tokens_total") >= cached as f64);
            assert!(stack.metric("layerstream_prefix_cache_queries_total") >= 2.0);
            let a = openai_chat(&stack, "What is a KV cache? Answer in one sentence, please.");
            let b = openai_chat(&stack, "What is a KV cache? Answer in one sentence, please.");
            // The first shares only the chat template's opening with earlier prompts; the second
            // all but its last block.
            let cached = |v: &serde_json::Value| {
                v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
            };
            let prompt = b["usage"]["prompt_tokens"].as_u64().unwrap();
            assert!(cached(&b) > cached(&a) && cached(&b) + 16 >= prompt, "{a} {b}");
            assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
        } else {
            assert_eq!(cached, 0, "{again}");
        }
        // Batched: three at once (two share the long prompt) beside one other.
        let addr = stack.addr().to_owned();
        let batched: Vec<Vec<u32>> = std::thread::scope(|s| {
            let hs: Vec<_> = [LONG, LONG, "Hi there, who are you?"]
                .map(|p| {
                    let addr = addr.clone();
                    s.spawn(move || submit(&addr, &["--chat", p, "--max-new-tokens", "12"]))
                })
                .into_iter()
                .collect();
            hs.into_iter().map(|h| ids(&h.join().unwrap(), "output_ids")).collect()
        });
        assert_eq!(batched[0], ids(&first, "output_ids"));
        assert_eq!(batched[1], ids(&first, "output_ids"));
        outputs.push((ids(&first, "output_ids"), batched));
        stack.shutdown();
    }
    assert_eq!(outputs[0], outputs[1], "the same tokens with the prefix cache on and off");
}

#[test]
fn a_full_pool_preempts_to_host_ram_or_replays_with_each_solo_output() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny(dir.path());
    let s = store.to_str().unwrap();
    let prompts =
        ["Tell me a story about a cat.", "What is the capital of France?", "Count to ten."];
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let v = last_json(&layerstream(&[
                "run",
                "--model",
                s,
                "--chat",
                p,
                "--max-new-tokens",
                "40",
                "--json",
            ]));
            ids(&v, "output_ids")
        })
        .collect();
    // 6 blocks of 16: one sequence (≤ 80 positions) fits, three at once do not. Without a host
    // tier a preempted sequence is replayed; with one its blocks go to host RAM and come back.
    for host in ["0", "64M"] {
        let flags = ["--kv-capacity", "96", "--no-prefix-cache", "--max-batch", "3"];
        let tier = ["--kv-host-bytes", host];
        let base = ["--workers", "2", "--resident-layers", "0"];
        let stack = Stack::up(&store, &[&base[..], &flags, &tier].concat());
        let addr = stack.addr().to_owned();
        let got: Vec<serde_json::Value> = std::thread::scope(|sc| {
            let hs: Vec<_> = prompts
                .map(|p| {
                    let addr = addr.clone();
                    sc.spawn(move || submit(&addr, &["--chat", p, "--max-new-tokens", "40"]))
                })
                .into_iter()
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (v, want) in got.iter().zip(&solo) {
            assert_eq!(&ids(v, "output_ids"), want, "host tier {host}: {v}");
        }
        let preempted: u64 = got.iter().map(|v| stat(v, "preemptions")).sum();
        assert!(preempted > 0, "the pool ran dry and a sequence was preempted");
        assert!(stack.metric("layerstream_preemptions_total") >= preempted as f64);
        let replayed = stack.metric("layerstream_preemption_replayed_tokens_total");
        let swapped = |dir: &str| {
            stack.metric(&format!("layerstream_kv_swapped_blocks_total{{direction=\"{dir}\"}}"))
        };
        let bytes_back =
            stack.metric("layerstream_kv_swapped_bytes_total{direction=\"to_device\"}");
        if host == "0" {
            assert!(replayed > 0.0 && swapped("to_host") == 0.0, "replayed {replayed}");
        } else {
            // Every block that went out came back; nothing was computed twice.
            assert_eq!(replayed, 0.0);
            assert!(swapped("to_device") > 0.0 && swapped("to_device") == swapped("to_host"));
            assert!(bytes_back > 0.0);
        }
        stack.shutdown();
    }
}

#[test]
fn every_kv_dtype_runs_and_bad_kv_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny(dir.path());
    let s = store.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["run", "--model", s, "--chat", LONG, "--max-new-tokens", "16", "--json"];
        a.extend_from_slice(extra);
        ids(&last_json(&layerstream(&a)), "output_ids")
    };
    let exact = run(&[]);
    assert_eq!(run(&["--kv-dtype", "f32", "--kv-block", "4"]), exact, "block size changes nothing");
    for d in ["f16", "bf16", "q8_0", "q4_0"] {
        assert_eq!(run(&["--kv-dtype", d]).len(), 16, "{d}");
    }
    // Through a 2-worker stack each worker stores q4_0 (the plan carries the dtype).
    let up = ["up", "--model", s, "--workers", "2", "--kv-dtype", "q4_0", "--prompt", LONG];
    let text = layerstream(&[&up[..], &["--max-new-tokens", "8"]].concat());
    assert!(!text.trim().is_empty());
    let e = layerstream_fails(&["run", "--model", s, "--prompt", "Hi", "--kv-dtype", "q5_0"]);
    assert!(e.contains("unknown KV dtype \"q5_0\"") && e.contains("q4_0"), "{e}");
    let e = layerstream_fails(&["run", "--model", s, "--prompt", "Hi", "--kv-block", "12"]);
    assert!(e.contains("12 is not a power of two"), "{e}");
    let e = layerstream_fails(&["up", "--model", s, "--prompt", "Hi", "--kv-dtype", "int3"]);
    assert!(e.contains("unknown KV dtype"), "{e}");
    let huge = ["up", "--model", s, "--prompt", "Hi", "--kv-host-bytes", "100000G"];
    let e = layerstream_fails(&huge);
    assert!(e.contains("--kv-host-bytes") && e.contains("more than this host's memory"), "{e}");
}

/// A prompt's cached blocks pushed off a small device pool by another request go to the host tier
/// and come back when the prompt returns (counted as cached tokens, blocks swapped to the device,
/// the same tokens); without the tier they are gone.
#[test]
fn evicted_prefix_blocks_come_back_from_host_ram() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny(dir.path());
    let other =
        "Write a long list of the colours of the rainbow, the planets of the solar system, \
        and the days of the week, each on its own line, without any explanation at all.";
    for host in ["16M", "0"] {
        // 4 blocks of 16: the second request needs all of them.
        let flags = ["--kv-capacity", "64", "--kv-host-bytes", host, "--workers", "2"];
        let stack = Stack::up(&store, &[&flags[..], &["--resident-layers", "0"]].concat());
        let job = |p: &str, n: &str| submit(stack.addr(), &["--prompt", p, "--max-new-tokens", n]);
        let first = job(LONG, "4");
        let evictor = job(other, "20");
        assert!(stat(&evictor, "prompt_tokens") + 20 > 48, "{evictor}");
        let again = job(LONG, "4");
        assert_eq!(ids(&again, "output_ids"), ids(&first, "output_ids"));
        let back = stack.metric("layerstream_kv_swapped_blocks_total{direction=\"to_device\"}");
        if host == "0" {
            assert_eq!(stat(&again, "cached_tokens"), 0, "{again}");
            assert_eq!(back, 0.0);
        } else {
            assert!(stat(&again, "cached_tokens") >= 32, "{again}");
            assert!(back >= 2.0, "{back} blocks came back");
        }
        stack.shutdown();
    }
}

/// f16 keys and values (the GPU default) keep SmolLM2's greedy tokens equal to transformers' up to
/// each golden's first near-tie, as f32 does.
#[test]
fn an_f16_cache_keeps_transformers_greedy_tokens() {
    let store = default_store().expect("the default model");
    for g in goldens("smollm2") {
        assert_greedy("smollm2", &g, &run_golden_with(&store, &g, &["--kv-dtype", "f16"]));
    }
}
