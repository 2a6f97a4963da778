//! Gemma 3 (tiny random Gemma3ForCausalLM, tests/fixtures/gemma3/gen.py): sandwich norms by 1 + w,
//! GeGLU, √hidden embeddings, q/k norms, five sliding-window layers (window 8, RoPE base 10⁴) to one
//! global layer (base 10⁶, linear scaling 2), a SentencePiece tokenizer trained for it — from the HF
//! directory and from the GGUF llama.cpp's converter wrote, equal to transformers.

use layerstream_tests::stack::*;
use layerstream_tests::*;

fn check(src: &std::path::Path) {
    let dir = tempfile::tempdir().unwrap();
    let store = import(src, dir.path());
    store.verify().unwrap();
    let g = store.manifest.config.gemma.clone().expect("a Gemma config");
    assert_eq!(g.global_layers, vec![5]);
    assert_eq!(g.sliding_window, 8);
    check_model_against_goldens("tiny-gemma3", &store);
}

#[test]
fn tiny_gemma3_from_hf_matches_transformers() {
    check(&model_dir("tiny-gemma3"));
}

#[test]
fn tiny_gemma3_gguf_from_llama_cpp_matches_transformers() {
    check(&fixtures().join("gguf").join("tiny-gemma3-f32.gguf"));
}

/// Streamed over two workers (layers split, sliding and global on different workers) with a chunked
/// prefill longer than the window: the same tokens.
#[test]
fn tiny_gemma3_streamed_equals_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-gemma3"), dir.path());
    let stack = Stack::up(
        &store.dir,
        &["--workers", "2", "--resident-layers", "1", "--max-step-tokens", "5"],
    );
    for g in goldens("tiny-gemma3") {
        let n = comparable_steps(&g).min(g.greedy_ids.len());
        let out = submit(
            stack.addr(),
            &golden_args(&g, n).iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let got: Vec<u32> = serde_json::from_value(out["output_ids"].clone()).unwrap();
        assert_greedy("tiny-gemma3", &g, &got);
    }
    stack.shutdown();
}
