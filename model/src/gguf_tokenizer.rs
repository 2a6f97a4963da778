//! Rebuilds an HF `tokenizer.json` from GGUF tokenizer metadata (gpt2-style byte-level BPE), so the
//! `tokenizers` crate encodes exactly as the original HF tokenizer did.

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};
use serde_json::{json, Map};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The GPT-2 pre-tokenizer split (also used by `tokenizer.ggml.pre` = smollm, starcoder, gpt-2).
const GPT2_PRE: &[&str] = &["default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", "olmo"];
/// Qwen2's split regex (Qwen2, 2.5, 3): Llama 3's with digits one at a time.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split regex.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn strings<'a>(g: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    let arr =
        g.metadata.get(key).and_then(Value::as_array).ok_or_else(|| {
            Error::Tokenizer(format!("GGUF metadata {key} missing or not an array"))
        })?;
    arr.iter()
        .map(|v| v.as_str().ok_or_else(|| Error::Tokenizer(format!("{key}: non-string entry"))))
        .collect()
}

/// Produces `tokenizer.json` text for a GGUF file's gpt2 BPE tokenizer.
pub fn tokenizer_json(g: &GgufFile) -> Result<String> {
    let model = g.metadata.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
    if model != "gpt2" {
        return Err(Error::Tokenizer(format!(
            "GGUF tokenizer model {model:?} unsupported; supported: gpt2 (byte-level BPE)"
        )));
    }
    let pre = g.metadata.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = if GPT2_PRE.contains(&pre) {
        byte_level.clone()
    } else if let Some(regex) = match pre {
        "llama-bpe" | "llama3" => Some(LLAMA3_REGEX),
        "qwen2" => Some(QWEN2_REGEX),
        _ => None,
    } {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})
    } else {
        return Err(Error::Tokenizer(format!(
            "GGUF pre-tokenizer {pre:?} unsupported; supported: {}, llama-bpe, qwen2",
            GPT2_PRE.join(", ")
        )));
    };
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let merges = strings(g, "tokenizer.ggml.merges")?;
    let types: Vec<i64> =
        match g.metadata.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(a) => a
                .iter()
                .map(|v| match v {
                    Value::I64(x) => *x,
                    Value::U64(x) => *x as i64,
                    _ => 1,
                })
                .collect(),
            None => vec![1; tokens.len()],
        };
    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert((*tok).to_owned(), json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({"id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == TOKEN_TYPE_CONTROL}));
        }
    }
    let add_bos =
        g.metadata.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false);
    let bos = g.metadata.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64);
    let post_processor = match (add_bos, bos) {
        (true, Some(id)) => {
            let tok = tokens.get(id as usize).copied().unwrap_or_default();
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tok: {"id": tok, "ids": [id], "tokens": [tok]}}})
        }
        _ => serde_json::Value::Null,
    };
    // Llama 3's tokenizer takes a whole word that is in the vocabulary as it is, without merging up
    // to it (HF `ignore_merges`; llama.cpp does the same for this pre-tokenizer): "Việt" is one token.
    let ignore_merges = matches!(pre, "llama-bpe" | "llama3");
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                  "vocab": vocab, "merges": merges},
    });
    Ok(doc.to_string())
}
