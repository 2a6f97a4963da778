//! Mixture-of-experts models (Qwen3-MoE: 16 experts, top-4, normalised; Mixtral: 8 experts, top-2)
//! from the hub's per-expert HF layout and from GGUFs llama.cpp's converter wrote: the store keeps
//! every expert in its own checksummed file, `run` equals transformers' goldens, and `up` streams
//! only the experts a step needs through a small device cache with the same tokens.

use layerstream_tests::stack::*;
use layerstream_tests::*;

/// A GGUF that llama.cpp's convert_hf_to_gguf.py wrote from the tiny checkpoint (lossless types;
/// tests/fixtures/gguf/gen.sh).
fn converted(name: &str) -> std::path::PathBuf {
    let ty = if name == "tiny-qwen3-moe" { "bf16" } else { "f16" };
    fixtures().join("gguf").join(format!("{name}-{ty}.gguf"))
}

fn check(name: &str, src: &std::path::Path) {
    let dir = tempfile::tempdir().unwrap();
    let store = import(src, dir.path());
    store.verify().unwrap();
    let m = store.manifest.config.moe.clone().expect("a mixture-of-experts config");
    for l in 0..store.manifest.config.num_layers {
        let layer = store.manifest.file(&layerstream_model::layout::layer_file(l)).unwrap();
        assert!(
            layer.tensor("router").is_some() && layer.tensor("gate").is_none(),
            "{name}: layer {l}"
        );
        for e in 0..m.experts {
            let f = store.manifest.file(&layerstream_model::layout::expert_file(l, e)).unwrap();
            let names: Vec<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
            assert_eq!(names, ["gate", "up", "down"], "{name}: expert {e} of layer {l}");
            assert_eq!(f.size % 4096, 0);
        }
    }
    check_model_against_goldens(name, &store);
}

#[test]
fn tiny_qwen3_moe_matches_transformers() {
    check("tiny-qwen3-moe", &model_dir("tiny-qwen3-moe"));
}

#[test]
fn tiny_mixtral_matches_transformers() {
    check("tiny-mixtral", &model_dir("tiny-mixtral"));
}

/// llama.cpp's `qwen3moe` file (stacked `ffn_*_exps`, split into one file per expert at import).
#[test]
fn qwen3_moe_gguf_from_llama_cpp_matches_transformers() {
    check("tiny-qwen3-moe", &converted("tiny-qwen3-moe"));
}

/// llama.cpp's Mixtral file: `llama` with `expert_count`, q/k rows permuted, stacked experts.
#[test]
fn mixtral_gguf_from_llama_cpp_matches_transformers() {
    check("tiny-mixtral", &converted("tiny-mixtral"));
}

/// Bytes a step would stream if every layer moved whole (its file and every expert).
fn whole_layer_bytes(store: &layerstream_model::Store) -> u64 {
    store.manifest.files.iter().filter(|f| f.name.starts_with("layer_")).map(|f| f.size).sum()
}

/// `up` with a small expert cache (misses happen, predictions copy ahead) and with one or two
/// workers equals transformers; only the experts a step needs move, far less than whole layers.
fn streamed(name: &str, src: &std::path::Path, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let store = import(src, dir.path());
    let m = store.manifest.config.moe.clone().unwrap();
    let stack = Stack::up(&store.dir, extra);
    for g in goldens(name) {
        let n = comparable_steps(&g).min(g.greedy_ids.len());
        let out = submit(
            stack.addr(),
            &golden_args(&g, n).iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let got: Vec<u32> = serde_json::from_value(out["output_ids"].clone()).unwrap();
        assert_greedy(name, &g, &got);
        let st = &out["stats"];
        let num = |k: &str| st[k].as_u64().unwrap();
        let (needed, hit, pre, missed) = (
            num("experts_needed"),
            num("experts_hit"),
            num("experts_prefetched"),
            num("experts_missed"),
        );
        assert_eq!(needed, hit + pre + missed, "{name}/{}: {st}", g.name);
        // Every layer of every step chose at least top_k distinct experts, at most all of them.
        let layer_steps = num("steps") * store.manifest.config.num_layers as u64;
        assert!(needed >= layer_steps * m.top_k as u64 && needed <= layer_steps * m.experts as u64);
        assert!(missed > 0, "{name}/{}: a small cache misses: {st}", g.name);
        assert!(
            num("bytes_streamed") < num("steps") * whole_layer_bytes(&store) / 2,
            "{name}/{}: {} bytes streamed, whole layers would be {} a step: {st}",
            g.name,
            num("bytes_streamed"),
            whole_layer_bytes(&store)
        );
    }
    stack.shutdown();
}

#[test]
fn qwen3_moe_streams_experts_through_a_small_cache() {
    streamed(
        "tiny-qwen3-moe",
        &model_dir("tiny-qwen3-moe"),
        &["--workers", "1", "--expert-cache", "6"],
    );
}

#[test]
fn mixtral_streams_experts_over_two_workers() {
    streamed(
        "tiny-mixtral",
        &model_dir("tiny-mixtral"),
        &["--workers", "2", "--expert-cache", "3"],
    );
}

#[test]
fn gguf_moe_streams_over_two_workers() {
    streamed(
        "tiny-qwen3-moe",
        &converted("tiny-qwen3-moe"),
        &["--workers", "2", "--expert-cache", "5"],
    );
}

/// Predictions copy experts ahead: with the attention resident and a cache too small for a cycle,
/// some of the experts a layer needs were already brought in on the previous layer's guess.
#[test]
fn predictions_bring_experts_in_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-qwen3-moe"), dir.path());
    let stack = Stack::up(&store.dir, &["--workers", "1", "--expert-cache", "8"]);
    let g = &goldens("tiny-qwen3-moe")[0];
    let out =
        submit(stack.addr(), &golden_args(g, 12).iter().map(String::as_str).collect::<Vec<_>>());
    let pre = out["stats"]["experts_prefetched"].as_u64().unwrap();
    assert!(pre > 0, "{}", out["stats"]);
    stack.shutdown();
}

/// The trace shows where a layer's experts came from: an `experts` span per MoE layer computed
/// (needed = hit + prefetched + missed), an `expert` span per copy onto the device, and the copy
/// thread's `prefetch experts` spans in the same trace.
#[test]
fn traces_show_expert_fetches_and_predictions() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-qwen3-moe"), dir.path());
    let spans_file = dir.path().join("spans.jsonl");
    let (mut sink, stack) =
        traced_stack_of(&store.dir, &spans_file, &["--workers", "1", "--expert-cache", "8"]);
    let g = &goldens("tiny-qwen3-moe")[0];
    let out =
        submit(stack.addr(), &golden_args(g, 8).iter().map(String::as_str).collect::<Vec<_>>());
    stack.shutdown();
    let spans = whole_traces(&spans_file, &[out["trace_id"].as_str().unwrap()]);
    sink.stop();
    let named = |n: &str| spans.iter().filter(|s| s["name"] == n).collect::<Vec<_>>();
    let layers = named("experts");
    assert_eq!(layers.len(), 8 * 4, "one per layer of each of the 8 steps");
    let sum = |k: &str| layers.iter().map(|s| s["attributes"][k].as_i64().unwrap()).sum::<i64>();
    assert_eq!(sum("needed"), sum("hit") + sum("prefetched") + sum("missed"));
    assert_eq!(sum("needed") as u64, out["stats"]["experts_needed"].as_u64().unwrap());
    assert!(!named("expert").is_empty() && !named("prefetch experts").is_empty());
    assert!(!named("predict experts").is_empty());
}

/// Batched rows equal solo rows: concurrent jobs through a streamed expert cache each produce what
/// `run` produces alone.
#[test]
fn concurrent_jobs_equal_solo_runs() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-mixtral"), dir.path());
    let solo = solo_runs(&store.dir);
    let stack = Stack::up(&store.dir, &["--workers", "2", "--expert-cache", "4"]);
    let outs = concurrent_jobs(stack.addr());
    for (i, (o, want)) in outs.iter().zip(&solo).enumerate() {
        let got: Vec<u32> = serde_json::from_value(o["output_ids"].clone()).unwrap();
        assert_eq!(&got, want, "job {i}");
    }
    assert!(
        outs.iter().any(|o| o["stats"]["max_batch"].as_u64().unwrap() > 1),
        "jobs were batched"
    );
    stack.shutdown();
}

/// The hot set persists: a stack counts which experts its steps routed to and saves the counts per
/// store under the cache root when it stops; the next stack of the same store starts with the
/// hottest experts already in its cache. Judged on a one-step request (the prompt's pass), where no
/// hit can come from anything but what the cache held before the step: a stack without a history
/// hits none; one with it hits some, and gives the same token.
#[test]
fn the_hottest_experts_are_loaded_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-qwen3-moe"), dir.path());
    let g = &goldens("tiny-qwen3-moe")[0];
    let run = |cache: &std::path::Path, steps: usize| {
        let env = [("LAYERSTREAM_CACHE", cache.to_str().unwrap())];
        let args = golden_args(g, steps);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let stack = Stack::up_env(&store.dir, &["--workers", "1", "--expert-cache", "12"], &env);
        let out = submit(stack.addr(), &args);
        stack.shutdown();
        out
    };
    let (cache, fresh) = (dir.path().join("cache"), dir.path().join("fresh"));
    let first = run(&cache, 8);
    let saved = cache.join("expert-usage").join(format!("{}.json", store.identity()));
    let file = |p: &std::path::Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).expect("the usage history is saved")).unwrap()
    };
    let history: Vec<(u32, u32, u64)> =
        serde_json::from_value(file(&saved)["counts"].clone()).unwrap();
    let routed: u64 = history.iter().map(|h| h.2).sum();
    assert_eq!(routed, first["stats"]["experts_needed"].as_u64().unwrap(), "every need counted");
    // A first run counts no novelty (every expert is new to an empty history).
    assert_eq!(file(&saved)["novel"][0].as_f64(), Some(0.0), "{}", file(&saved));
    let (cold, warm) = (run(&fresh, 1), run(&cache, 1));
    // The second run started with a history: its needs are counted for novelty.
    let needs = file(&saved)["novel"][0].as_f64().unwrap();
    assert_eq!(needs, warm["stats"]["experts_needed"].as_f64().unwrap(), "{}", file(&saved));
    let hit = |o: &serde_json::Value| o["stats"]["experts_hit"].as_u64().unwrap();
    assert_eq!(hit(&cold), 0, "an empty cache hits nothing in one step");
    assert!(hit(&warm) > 0, "the hot set was loaded: {} hits", hit(&warm));
    let first_token = |o: &serde_json::Value| o["output_ids"][0].clone();
    assert_eq!(first_token(&warm), first_token(&first));
    assert_eq!(first_token(&cold), first_token(&first));
}
