//! When a sequence ends and what text it has produced so far: end-of-sequence tokens, stop strings
//! and the token budget, over text decoded incrementally (each token costs a decode of a few tokens,
//! not of the whole output). `run` and the coordinator's scheduler both feed tokens through `Stopper`,
//! so they end sequences by the same rules and stream the same text.

use crate::generation::GenerateParams;
use layerstream_model::tokenizer::Tokenizer;
use layerstream_model::Result;
pub use layerstream_proto::v1::FinishReason;

/// The lowercase name of a reason as `run --json`, `submit --json` and OpenAI clients show it.
pub fn reason_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Unspecified => "",
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
        FinishReason::Error => "error",
        FinishReason::ToolCalls => "tool_calls",
    }
}

/// Serializes a reason by its `reason_name` (for `serde(serialize_with)`).
pub fn serialize_reason<S: serde::Serializer>(
    r: &FinishReason,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(reason_name(*r))
}

/// What one token did to a sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Text that became final with this token (may be empty: an incomplete character or a possible
    /// stop string is held back).
    pub delta: String,
    /// Set when the sequence ended with this token.
    pub finish: Option<FinishReason>,
}

/// One sequence's stop criteria and incrementally decoded output.
#[derive(Debug, Clone)]
pub struct Stopper {
    eos: Vec<u32>,
    /// `stop_token_ids`: end the output like end-of-sequence, whatever `ignore_eos` says.
    stop_ids: Vec<u32>,
    ignore_eos: bool,
    max_new_tokens: usize,
    stop: Vec<String>,
    ids: Vec<u32>,
    /// Decoding window: `ids[prefix..read]` is decoded text already in `text`, kept as context so a
    /// tokenizer's leading-space rules see what came before; `ids[read..]` is not in `text` yet.
    prefix: usize,
    read: usize,
    /// The output text so far (complete characters; after a stop string matched, cut before it).
    pub text: String,
    emitted: usize,
}

impl Stopper {
    /// Stop criteria of `p` with the model's end-of-sequence ids.
    pub fn new(p: &GenerateParams, eos: &[u32]) -> Self {
        Stopper {
            eos: eos.to_vec(),
            stop_ids: p.sampling.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
            max_new_tokens: p.max_new_tokens,
            stop: p.stop.clone(),
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            emitted: 0,
        }
    }

    /// Every token generated so far.
    pub fn output(&self) -> &[u32] {
        &self.ids
    }

    /// Decodes what `ids[read..]` adds to the text; `complete` takes it even if it ends inside a
    /// character (the sequence is over).
    fn decode_new(&mut self, tok: &Tokenizer, complete: bool) -> Result<()> {
        if self.read == self.ids.len() {
            return Ok(());
        }
        let before = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        if !complete && now.ends_with('\u{FFFD}') {
            return Ok(());
        }
        let piece = match now.get(before.len()..) {
            Some(p) if now.starts_with(&before) => p,
            // The window's earlier text changed (rare merges across the window): take the whole
            // window's text past what it decoded to before, by characters.
            _ => {
                &now[now.char_indices().nth(before.chars().count()).map_or(now.len(), |(i, _)| i)..]
            }
        };
        self.text.push_str(piece);
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(())
    }

    /// Feeds the next generated token.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Progress> {
        self.ids.push(id);
        if (!self.ignore_eos && self.eos.contains(&id)) || self.stop_ids.contains(&id) {
            self.decode_new(tok, true)?;
            return Ok(self.end(FinishReason::Stop));
        }
        let searched = self.text.len();
        self.decode_new(tok, false)?;
        if !self.stop.is_empty() {
            let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
            let mut from = searched.saturating_sub(longest.saturating_sub(1));
            while !self.text.is_char_boundary(from) {
                from -= 1;
            }
            if let Some(cut) = self
                .stop
                .iter()
                .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
                .min()
            {
                self.text.truncate(cut);
                return Ok(self.end(FinishReason::Stop));
            }
        }
        if self.ids.len() >= self.max_new_tokens {
            self.decode_new(tok, true)?;
            return Ok(self.end(FinishReason::Length));
        }
        // Hold back anything that may begin a stop string.
        let hold = self.stop.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
        let mut safe = self.text.len().saturating_sub(hold).max(self.emitted);
        while !self.text.is_char_boundary(safe) {
            safe -= 1;
        }
        let delta = self.text[self.emitted..safe].to_owned();
        self.emitted = safe;
        Ok(Progress { delta, finish: None })
    }

    fn end(&mut self, reason: FinishReason) -> Progress {
        Progress { delta: self.flush(), finish: Some(reason) }
    }

    /// Everything not streamed yet.
    pub fn flush(&mut self) -> String {
        let start = self.emitted.min(self.text.len());
        let rest = self.text[start..].to_owned();
        self.emitted = self.text.len();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level tokenizer whose ids are bytes 0..=255 and whose id 256 is an end-of-sequence
    /// special token: multi-byte characters arrive a byte at a time.
    fn bytes_tokenizer() -> Tokenizer {
        let mut vocab = serde_json::Map::new();
        for b in 0u8..=255 {
            vocab.insert(format!("<0x{b:02X}>"), serde_json::json!(b));
        }
        vocab.insert("</s>".into(), serde_json::json!(256));
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 256, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "ByteFallback"},
            "model": {"type": "BPE", "vocab": vocab, "merges": [], "byte_fallback": true, "unk_token": null}
        });
        Tokenizer::from_json(json.to_string().as_bytes(), None, None, Some(256)).unwrap()
    }

    fn feed(s: &mut Stopper, tok: &Tokenizer, text: &str) -> (String, Option<FinishReason>) {
        let mut out = String::new();
        for &b in text.as_bytes() {
            let p = s.push(tok, b as u32).unwrap();
            out.push_str(&p.delta);
            if p.finish.is_some() {
                return (out, p.finish);
            }
        }
        (out, None)
    }

    fn params(max: usize, stop: &[&str]) -> GenerateParams {
        GenerateParams {
            max_new_tokens: max,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn streams_whole_characters_and_ends_at_the_budget() {
        let tok = bytes_tokenizer();
        let mut s = Stopper::new(&params(100, &[]), &[256]);
        let mut deltas = Vec::new();
        for &b in "aé€".as_bytes() {
            deltas.push(s.push(&tok, b as u32).unwrap().delta);
        }
        assert_eq!(
            deltas,
            vec!["a", "", "é", "", "", "€"],
            "a character is streamed when its last byte arrives"
        );
        let mut s = Stopper::new(&params(3, &[]), &[256]);
        assert_eq!(feed(&mut s, &tok, "abcdef"), ("abc".into(), Some(FinishReason::Length)));
        assert_eq!(s.output().len(), 3);
    }

    #[test]
    fn stop_strings_cut_the_text_and_are_never_streamed() {
        let tok = bytes_tokenizer();
        let mut s = Stopper::new(&params(100, &["END", "\n\n"]), &[256]);
        let (streamed, why) = feed(&mut s, &tok, "one ENtwo END three");
        assert_eq!(why, Some(FinishReason::Stop));
        assert_eq!(streamed, "one ENtwo ");
        assert_eq!(s.text, "one ENtwo ");
        let mut s = Stopper::new(&params(100, &["é"]), &[256]);
        assert_eq!(
            feed(&mut s, &tok, "caé"),
            ("ca".into(), Some(FinishReason::Stop)),
            "a multi-byte stop string"
        );
    }

    #[test]
    fn eos_ends_unless_ignored() {
        let tok = bytes_tokenizer();
        let mut s = Stopper::new(&params(100, &[]), &[256]);
        feed(&mut s, &tok, "hi");
        let p = s.push(&tok, 256).unwrap();
        assert_eq!((p.finish, s.text.as_str()), (Some(FinishReason::Stop), "hi"));
        let mut s = Stopper::new(&GenerateParams { ignore_eos: true, ..params(4, &[]) }, &[256]);
        feed(&mut s, &tok, "hi");
        assert_eq!(s.push(&tok, 256).unwrap().finish, None);
        assert_eq!(s.push(&tok, b'!' as u32).unwrap().finish, Some(FinishReason::Length));
        assert_eq!(s.text, "hi!");
    }

    #[test]
    fn incremental_text_equals_decoding_the_whole_output() {
        let tok = bytes_tokenizer();
        let text = "Grüße, 世界! ends here";
        let mut s = Stopper::new(&params(text.len(), &[]), &[256]);
        let (streamed, why) = feed(&mut s, &tok, text);
        assert_eq!(why, Some(FinishReason::Length));
        assert_eq!(streamed, text);
        assert_eq!(s.text, tok.decode(s.output(), true).unwrap());
        assert_eq!(reason_name(FinishReason::Cancelled), "cancelled");
    }
}
