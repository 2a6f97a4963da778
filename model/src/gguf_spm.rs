//! Rebuilds an HF `tokenizer.json` from a GGUF SentencePiece vocabulary (`tokenizer.ggml.model` =
//! `llama`: Llama 2, Mistral, Phi-3; `gemma4`: Gemma's), the way transformers' converters build the
//! fast tokenizer: a BPE model with byte fallback whose merges are the vocabulary's pairs ranked by the
//! merged piece's score (as `SentencePieceExtractor` does), or the file's own merges where it carries
//! them; spaces become `▁`, with a `▁` prepended to the text when the vocabulary says so
//! (`tokenizer.ggml.add_space_prefix`, default on for `llama`).

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};
use serde_json::json;
use std::collections::HashMap;

use crate::gguf_tokenizer::{
    vocab_and_added, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED,
};

/// The vocabulary's pieces, scores and types.
pub struct Pieces<'a> {
    pub tokens: Vec<&'a str>,
    pub scores: Vec<f32>,
    pub types: Vec<i64>,
}

/// Merges ranked as transformers' `SentencePieceExtractor` ranks them: pieces by score (highest
/// first, ties by id), each piece's splits into two pieces of the vocabulary ordered by their ids.
pub fn merges_from_scores(p: &Pieces) -> Vec<(String, String)> {
    let vocab: HashMap<&str, usize> = p.tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut order: Vec<usize> = (0..p.tokens.len()).collect();
    order.sort_by(|&a, &b| p.scores[b].total_cmp(&p.scores[a]).then(a.cmp(&b)));
    let mut merges = Vec::new();
    for i in order {
        let piece = p.tokens[i];
        let mut local: Vec<(usize, usize, &str, &str)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                Some((*vocab.get(l)?, *vocab.get(r)?, l, r))
            })
            .collect();
        local.sort();
        merges.extend(local.into_iter().map(|(_, _, l, r)| (l.to_owned(), r.to_owned())));
    }
    merges
}

/// `tokenizer.json` text for a GGUF SentencePiece vocabulary (`model` is its `tokenizer.ggml.model`).
pub fn tokenizer_json(
    g: &GgufFile,
    model: &str,
    tokens: Vec<&str>,
    types: Vec<i64>,
) -> Result<String> {
    let scores: Vec<f32> = match g.metadata.get("tokenizer.ggml.scores").and_then(Value::as_array) {
        Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
        None => return Err(Error::Tokenizer("GGUF metadata tokenizer.ggml.scores missing".into())),
    };
    if scores.len() != tokens.len() {
        return Err(Error::Tokenizer(format!(
            "{} scores for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    let p = Pieces { tokens, scores, types };
    let merges: Vec<(String, String)> = match g.metadata.get("tokenizer.ggml.merges") {
        Some(_) => crate::gguf_tokenizer::strings(g, "tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                let (l, r) = m
                    .split_once(' ')
                    .ok_or_else(|| Error::Tokenizer(format!("merge {m:?} is not two pieces")))?;
                Ok((l.to_owned(), r.to_owned()))
            })
            .collect::<Result<_>>()?,
        None => merges_from_scores(&p),
    };
    let prefix = g
        .metadata
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(Value::as_bool)
        .unwrap_or(model == "llama");
    let kinds = [TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN];
    let (vocab, added) = vocab_and_added(&p.tokens, &p.types, &kinds);
    let unk = p.types.iter().position(|&t| t == TOKEN_TYPE_UNKNOWN).map(|i| p.tokens[i]);
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
    let normalizer = if prefix {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace]})
    } else {
        replace
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": crate::gguf_tokenizer::bos_processor(g, &p.tokens),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    Ok(doc.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces rank by score; each piece's splits by the ids of their halves.
    #[test]
    fn merges_follow_scores_then_ids() {
        let p = Pieces {
            tokens: vec!["a", "b", "c", "ab", "abc", "bc"],
            scores: vec![0.0, 0.0, 0.0, -1.0, -3.0, -2.0],
            types: vec![1; 6],
        };
        let m = merges_from_scores(&p);
        let want = [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")];
        assert_eq!(m, want.map(|(l, r)| (l.to_owned(), r.to_owned())));
    }
}
