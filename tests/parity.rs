//! Parity with transformers on the tiny reference checkpoints (llama3 RoPE + tied f32; Qwen2 bf16
//! sharded with q/k/v bias; Qwen3 f16 with q/k norm and head_dim ≠ hidden/heads), through the real
//! importer and the real `layerstream run` binary.

use layerstream_tests::*;

fn check(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir(name), dir.path());
    store.verify().unwrap();
    check_model_against_goldens(name, &store);
}

#[test]
fn tiny_llama_matches_transformers() {
    check("tiny-llama");
}

#[test]
fn tiny_qwen2_matches_transformers() {
    check("tiny-qwen2");
}

#[test]
fn tiny_qwen3_matches_transformers() {
    check("tiny-qwen3");
}

/// Mistral with a sliding window (6 positions, every layer; prompts of 12–31 tokens).
#[test]
fn tiny_mistral_sliding_window_matches_transformers() {
    check("tiny-mistral");
}

#[test]
fn chat_flag_and_messages_file_render_the_same_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let s = store.dir.to_str().unwrap();
    let msgs = dir.path().join("m.json");
    std::fs::write(&msgs, r#"[{"role": "user", "content": "What is the capital of France?"}]"#)
        .unwrap();
    let a = last_json(&layerstream(&[
        "run",
        "--model",
        s,
        "--chat",
        "What is the capital of France?",
        "--max-new-tokens",
        "3",
        "--json",
    ]));
    let b = last_json(&layerstream(&[
        "run",
        "--model",
        s,
        "--messages",
        msgs.to_str().unwrap(),
        "--max-new-tokens",
        "3",
        "--json",
    ]));
    let g = goldens("tiny-llama").into_iter().find(|g| g.name == "capital").unwrap();
    assert_eq!(a["input_ids"], serde_json::json!(g.input_ids));
    assert_eq!(a["output_ids"], b["output_ids"]);
    assert_eq!(a["output_ids"].as_array().unwrap().len(), 3);
}

#[test]
fn seeded_sampling_is_reproducible_and_stop_strings_cut() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-qwen2"), dir.path());
    let s = store.dir.to_str().unwrap();
    let sampled = [
        "run",
        "--model",
        s,
        "--prompt",
        "The quick brown fox",
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--repetition-penalty",
        "1.1",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--json",
    ];
    let args = |seed: &str, extra: &[&str]| {
        last_json(&layerstream(&[&sampled[..], &["--seed", seed], extra].concat()))
    };
    let (a, b, c) = (args("7", &[]), args("7", &[]), args("8", &[]));
    assert_eq!(a["output_ids"], b["output_ids"]);
    assert_ne!(a["output_ids"], c["output_ids"]);
    // A stop string taken from the sampled text ends generation there and is not returned.
    let text = a["text"].as_str().unwrap().to_owned();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let d = args("7", &["--stop", &stop]);
    assert_eq!(d["finish_reason"], "stop");
    let cut = d["text"].as_str().unwrap();
    assert!(
        !cut.contains(&stop) && text.starts_with(cut) && text[cut.len()..].starts_with(&stop),
        "{text:?} / {cut:?} / {stop:?}"
    );
}

#[test]
fn eos_ends_generation_unless_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let s = store.dir.to_str().unwrap();
    // Feed a prompt whose greedy continuation is known, then declare its 3rd token the EOS by
    // rewriting the manifest's eos id: generation must stop right there.
    let g = &goldens("tiny-llama")[1];
    declare_eos(&store.dir, g.greedy_ids[2]);
    let ids: Vec<String> = g.input_ids.iter().map(u32::to_string).collect();
    let run = |extra: &[&str]| {
        let mut a = vec!["run", "--model", s, "--token-ids"];
        let joined = ids.join(",");
        a.push(&joined);
        a.extend_from_slice(&["--max-new-tokens", "8", "--json"]);
        a.extend_from_slice(extra);
        last_json(&layerstream(&a))
    };
    let stopped = run(&[]);
    assert_eq!(
        stopped["finish_reason"], "stop",
        "an end-of-sequence token ends it as OpenAI's \"stop\""
    );
    assert_eq!(stopped["output_ids"], serde_json::json!(g.greedy_ids[..3]));
    let full = run(&["--ignore-eos"]);
    assert_eq!(full["output_ids"].as_array().unwrap().len(), 8);
}
