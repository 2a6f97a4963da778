//! Tokenizer and chat template of a store: encode as HF does, decode incrementally, render chats.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A loaded tokenizer plus the model's chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` text and an optional chat template.
    pub fn from_json(
        json: &[u8],
        chat_template: Option<String>,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
    ) -> Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_bytes(json).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let bos_token = bos_id.and_then(|id| inner.id_to_token(id));
        let eos_token = eos_id.and_then(|id| inner.id_to_token(id));
        Ok(Tokenizer { inner, chat_template, bos_token, eos_token })
    }

    /// Loads `tokenizer.json` from a file.
    pub fn from_file(
        path: &Path,
        chat_template: Option<String>,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
    ) -> Result<Self> {
        let bytes = crate::error::read_file(path)?;
        Self::from_json(&bytes, chat_template, bos_id, eos_id)
    }

    /// Encodes text with the tokenizer's special-token handling (as HF `encode` with defaults).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// Encodes a rendered chat template as transformers' `apply_chat_template(tokenize=True)` does:
    /// without adding special tokens (the template writes its own BOS; adding another would double it).
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>> {
        self.encode_with(rendered, false)
    }

    /// Encodes text; `add_special` adds what the tokenizer adds around a text (a BOS token, …), as
    /// HF's `add_special_tokens`.
    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc =
            self.inner.encode(text, add_special).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The tokenizer of a GGUF file (a whole model or a vocab-only file), rebuilt from its metadata.
    pub fn from_gguf(path: &Path) -> Result<Self> {
        let g = crate::gguf::GgufFile::open(path)?;
        let json = crate::gguf_tokenizer::tokenizer_json(&g)?;
        Self::from_json(json.as_bytes(), g.chat_template(), None, None)
    }

    /// Decodes ids to text; `skip_special` drops control tokens (HF `skip_special_tokens`).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Renders messages through the chat template, with the generation prompt appended.
    pub fn apply_chat_template(&self, messages: &[Message]) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            Error::Template("this model has no chat template; use --prompt".into())
        })?;
        render_chat(template, messages, self.bos_token.as_deref(), self.eos_token.as_deref())
    }
}

impl Tokenizer {
    /// Checks the chat template (if any) by rendering one user turn, so a template that cannot be
    /// parsed or rendered fails at import rather than at the first chat request.
    pub fn check_template(&self) -> Result<()> {
        if self.chat_template.is_some() {
            self.apply_chat_template(&[Message { role: "user".into(), content: "Hi".into() }])?;
        }
        Ok(())
    }
}

/// Renders a Jinja chat template the way transformers' `apply_chat_template` does.
pub fn render_chat(
    template: &str,
    messages: &[Message],
    bos: Option<&str>,
    eos: Option<&str>,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| crate::template_ext::strftime_now(&fmt));
    // Jinja2 (transformers) counts an undefined value as empty: `tools|length` is 0 without tools.
    env.add_filter(
        "length",
        |v: minijinja::Value| -> std::result::Result<usize, minijinja::Error> {
            if v.is_undefined() || v.is_none() {
                return Ok(0);
            }
            v.len().ok_or_else(|| {
                minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!("cannot calculate the length of {}", v.kind()),
                )
            })
        },
    );
    let template = crate::template_ext::generation_blocks(template);
    env.add_template_owned("chat", template).map_err(|e| Error::Template(e.to_string()))?;
    let tmpl = env.get_template("chat").map_err(|e| Error::Template(e.to_string()))?;
    tmpl.render(minijinja::context! {
        messages => messages,
        add_generation_prompt => true,
        bos_token => bos.unwrap_or(""),
        eos_token => eos.unwrap_or(""),
    })
    .map_err(|e| Error::Template(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_smollm_style_template() {
        let t = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nHi<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let m = vec![Message { role: "user".into(), content: "Q?".into() }];
        let out = render_chat(t, &m, None, None).unwrap();
        assert_eq!(out, "<|im_start|>system\nHi<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn transformers_extensions_render() {
        let t = "{{ strftime_now('%Y') }}|{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}";
        let m = vec![Message { role: "assistant".into(), content: "ok".into() }];
        let out = render_chat(t, &m, None, None).unwrap();
        let (year, rest) = out.split_once('|').unwrap();
        assert!(year.len() == 4 && year >= "2025", "{out}");
        assert_eq!(rest, "ok");
    }

    #[test]
    fn raise_exception_surfaces() {
        let t = "{{ raise_exception('roles must alternate') }}";
        let e = render_chat(t, &[], None, None).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
    }
}
