//! Rebuilds an HF `tokenizer.json` from GGUF tokenizer metadata (gpt2-style byte-level BPE here;
//! SentencePiece vocabularies in `gguf_spm`), so the `tokenizers` crate encodes exactly as the
//! original HF tokenizer did.

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};
use serde_json::{json, Map};

/// GGUF token types (llama.cpp `llama_token_type`).
pub(crate) const TOKEN_TYPE_UNKNOWN: i64 = 2;
pub(crate) const TOKEN_TYPE_CONTROL: i64 = 3;
pub(crate) const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The vocabulary map (token → id) and the added tokens: those whose type is in `added_kinds`,
/// special unless user-defined.
pub(crate) fn vocab_and_added(
    tokens: &[&str],
    types: &[i64],
    added_kinds: &[i64],
) -> (Map<String, serde_json::Value>, Vec<serde_json::Value>) {
    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert((*tok).to_owned(), json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if added_kinds.contains(&ty) {
            added.push(json!({"id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty != TOKEN_TYPE_USER_DEFINED}));
        }
    }
    (vocab, added)
}

/// The GPT-2 pre-tokenizer split.
const GPT2_PRE: &[&str] = &["default", "gpt2", "gpt-2", "olmo"];
/// GPT-2's split after every digit is split off on its own (SmolLM, StarCoder, Refact, Command R).
const DIGITS_PRE: &[&str] = &["smollm", "starcoder", "refact", "command-r"];
/// Qwen2's split regex (Qwen2, 2.5, 3): Llama 3's with digits one at a time.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek LLM's splits (llama.cpp's, non-ASCII written as escapes so no editor or normaliser can
/// fold the Kelvin sign or the Greek compatibility letters that bound its ranges), applied one after another (newlines; letter runs of the scripts listed; ASCII
/// and full-width punctuation runs; trailing spaces; CJK runs; digit runs), as llama.cpp and the HF
/// tokenizer apply them.
const DEEPSEEK_LLM_SPLITS: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}+",
];
/// DeepSeek Coder's splits.
const DEEPSEEK_CODER_SPLITS: &[&str] = &[
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}",
];
/// Llama 3's split regex.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A string-array metadata value.
pub(crate) fn strings<'a>(g: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    let arr =
        g.metadata.get(key).and_then(Value::as_array).ok_or_else(|| {
            Error::Tokenizer(format!("GGUF metadata {key} missing or not an array"))
        })?;
    arr.iter()
        .map(|v| v.as_str().ok_or_else(|| Error::Tokenizer(format!("{key}: non-string entry"))))
        .collect()
}

/// The tokens' GGUF types (1 = normal where the file has none).
fn token_types(g: &GgufFile, n: usize) -> Vec<i64> {
    match g.metadata.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        Some(a) => a
            .iter()
            .map(|v| match v {
                Value::I64(x) => *x,
                Value::U64(x) => *x as i64,
                _ => 1,
            })
            .collect(),
        None => vec![1; n],
    }
}

/// The post-processor that puts BOS first when the vocabulary asks for it (`add_bos_token`).
pub(crate) fn bos_processor(g: &GgufFile, tokens: &[&str]) -> serde_json::Value {
    let add_bos =
        g.metadata.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false);
    let bos = g.metadata.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64);
    match (add_bos, bos) {
        (true, Some(id)) => {
            let tok = tokens.get(id as usize).copied().unwrap_or_default();
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tok: {"id": tok, "ids": [id], "tokens": [tok]}}})
        }
        _ => serde_json::Value::Null,
    }
}

/// Produces `tokenizer.json` text for a GGUF file's tokenizer: gpt2 byte-level BPE, or a
/// SentencePiece vocabulary (`llama`, `gemma4`; see `gguf_spm`).
pub fn tokenizer_json(g: &GgufFile) -> Result<String> {
    let model = g.metadata.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
    if matches!(model, "llama" | "gemma4") {
        let tokens = strings(g, "tokenizer.ggml.tokens")?;
        let types = token_types(g, tokens.len());
        return crate::gguf_spm::tokenizer_json(g, model, tokens, types);
    }
    if model != "gpt2" {
        return Err(Error::Tokenizer(format!(
            "GGUF tokenizer model {model:?} unsupported; supported: gpt2 (byte-level BPE), llama and \
             gemma4 (SentencePiece)"
        )));
    }
    let pre = g.metadata.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let splits: &[&str] = match pre {
        "llama-bpe" | "llama3" => &[LLAMA3_REGEX],
        "qwen2" => &[QWEN2_REGEX],
        "deepseek-llm" => DEEPSEEK_LLM_SPLITS,
        "deepseek-coder" => DEEPSEEK_CODER_SPLITS,
        _ => &[],
    };
    let pre_tokenizer = if GPT2_PRE.contains(&pre) {
        byte_level.clone()
    } else if DIGITS_PRE.contains(&pre) {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated", "invert": false},
            byte_level.clone()]})
    } else if !splits.is_empty() {
        let mut seq: Vec<serde_json::Value> = splits
            .iter()
            .map(|r| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
            .collect();
        seq.push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}));
        json!({"type": "Sequence", "pretokenizers": seq})
    } else {
        return Err(Error::Tokenizer(format!(
            "GGUF pre-tokenizer {pre:?} unsupported; supported: {}, {}, llama-bpe, qwen2, \
             deepseek-llm, deepseek-coder",
            GPT2_PRE.join(", "),
            DIGITS_PRE.join(", ")
        )));
    };
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let merges = strings(g, "tokenizer.ggml.merges")?;
    let types = token_types(g, tokens.len());
    let (vocab, added) =
        vocab_and_added(&tokens, &types, &[TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED]);
    let post_processor = bos_processor(g, &tokens);
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

#[cfg(test)]
mod split_tests {
    use super::*;

    /// Every split rule compiles under the tokenizers crate's regex engine.
    #[test]
    fn split_rules_compile() {
        for r in DEEPSEEK_LLM_SPLITS
            .iter()
            .chain(DEEPSEEK_CODER_SPLITS)
            .chain(&[LLAMA3_REGEX, QWEN2_REGEX])
        {
            let j = json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false});
            let p: std::result::Result<tokenizers::PreTokenizerWrapper, _> =
                serde_json::from_value(j);
            assert!(p.is_ok(), "{r:?}: {:?}", p.err());
        }
    }
}
