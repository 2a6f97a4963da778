//! Tokenizer and chat template of a store: encode as HF does, decode incrementally, render chats.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One chat message, as transformers' templates see it (keys absent when unset).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant's tool calls: `[{"id", "type": "function", "function": {"name", "arguments"}}]`
    /// with `arguments` a JSON object (as vLLM hands them to templates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool result: the call it answers and the function's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A plain message.
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.into(), content: content.into(), ..Default::default() }
    }
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

    /// The first id whose token differs between this vocabulary and `other` (a token only one of
    /// them has included), with both tokens; None when the vocabularies are equal.
    pub fn first_difference(
        &self,
        other: &Tokenizer,
    ) -> Option<(u32, Option<String>, Option<String>)> {
        let n = self.vocab_size().max(other.vocab_size()) as u32;
        (0..n).find_map(|id| {
            let (a, b) = (self.inner.id_to_token(id), other.inner.id_to_token(id));
            (a != b).then_some((id, a, b))
        })
    }

    /// The bytes each token stands for, by id (special tokens marked with a leading 0xFF, as
    /// llguidance's token trie expects), read from the tokenizer's decoder description.
    pub fn token_bytes(&self) -> Result<Vec<Vec<u8>>> {
        let json: serde_json::Value = serde_json::from_str(
            &self.inner.to_string(false).map_err(|e| Error::Tokenizer(e.to_string()))?,
        )
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
        std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| Error::Tokenizer("a token's bytes could not be read".into()))?
            .map_err(|e| Error::Tokenizer(format!("token bytes: {e}")))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Renders messages through the chat template, with the generation prompt appended, within the
    /// default budget (`RenderBudget::default`).
    pub fn apply_chat_template(&self, messages: &[Message]) -> Result<String> {
        self.apply_chat_template_within(messages, RenderBudget::default())
    }

    /// As `apply_chat_template`, stopping with an error as soon as the rendering exceeds `budget`.
    pub fn apply_chat_template_within(
        &self,
        messages: &[Message],
        budget: RenderBudget,
    ) -> Result<String> {
        self.apply_chat_template_tools(messages, None, budget)
    }

    /// As `apply_chat_template_within`, with `tools` (OpenAI's list of `{"type": "function",
    /// "function": {…}}`) handed to the template as transformers' `apply_chat_template(tools=…)`.
    pub fn apply_chat_template_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        budget: RenderBudget,
    ) -> Result<String> {
        let template = self.chat_template()?;
        let (bos, eos) = (self.bos_token.as_deref(), self.eos_token.as_deref());
        render_chat_tools(template, messages, tools, bos, eos, budget)
    }

    /// The chat template, or an error saying there is none.
    pub fn chat_template(&self) -> Result<&str> {
        self.chat_template
            .as_deref()
            .ok_or_else(|| Error::Template("this model has no chat template; use --prompt".into()))
    }
}

impl Tokenizer {
    /// Checks the chat template (if any) within a small budget, so a template that cannot be
    /// parsed or rendered — or that amplifies a few words into megabytes — fails at import rather
    /// than at the first chat request: one user turn must render; a three-turn chat must stay
    /// within the budget (a template may refuse its shape: some allow no second turn).
    pub fn check_template(&self) -> Result<()> {
        if self.chat_template.is_none() {
            return Ok(());
        }
        let m = Message::new;
        let context = |n: &'static str| {
            move |e| match e {
                Error::Template(m) => Error::Template(format!("rendering {n}: {m}")),
                Error::TemplateBudget(m) => Error::TemplateBudget(format!("rendering {n}: {m}")),
                other => other,
            }
        };
        let budget = RenderBudget::IMPORT_CHECK;
        self.apply_chat_template_within(&[m("user", "Hi")], budget)
            .map_err(context("one user turn"))?;
        let chat = [m("user", "Hi"), m("assistant", "Hello."), m("user", "Bye")];
        match self.apply_chat_template_within(&chat, budget).map_err(context("a three-turn chat")) {
            Err(e @ Error::TemplateBudget(_)) => Err(e),
            _ => Ok(()),
        }
    }
}

/// What one rendering of a chat template may cost: output bytes (checked as they are written) and
/// minijinja fuel (about one unit per template instruction: CPU time), so a template from a model
/// file cannot turn a request into gigabytes or minutes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderBudget {
    pub max_bytes: usize,
    pub fuel: u64,
}

impl RenderBudget {
    /// The import check's budget for a chat of a few words: far above what real templates write
    /// (the largest of the 71 llama.cpp ships renders a few KB).
    pub const IMPORT_CHECK: RenderBudget = RenderBudget { max_bytes: 1 << 20, fuel: 5_000_000 };

    /// A budget of `max_bytes` output with the default fuel.
    pub fn bytes(max_bytes: usize) -> Self {
        RenderBudget { max_bytes, ..Self::default() }
    }
}

impl Default for RenderBudget {
    /// 16 MiB of output and 50M units of fuel (well under a second of rendering).
    fn default() -> Self {
        RenderBudget { max_bytes: 16 << 20, fuel: 50_000_000 }
    }
}

/// Output that refuses to grow past a bound: the rendering stops at the first write beyond it.
struct Capped {
    out: Vec<u8>,
    max: usize,
    /// A write was refused.
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.max {
            self.over = true;
            return Err(std::io::Error::other("over budget"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Renders a Jinja chat template the way transformers' `apply_chat_template` does, within the
/// default budget.
pub fn render_chat(
    template: &str,
    messages: &[Message],
    bos: Option<&str>,
    eos: Option<&str>,
) -> Result<String> {
    render_chat_within(template, messages, bos, eos, RenderBudget::default())
}

/// As `render_chat`, stopping with an error as soon as the rendering exceeds `budget`.
pub fn render_chat_within(
    template: &str,
    messages: &[Message],
    bos: Option<&str>,
    eos: Option<&str>,
    budget: RenderBudget,
) -> Result<String> {
    render_chat_tools(template, messages, None, bos, eos, budget)
}

/// A Jinja environment as transformers renders chat templates in: Jinja2's block trimming,
/// Python's string methods, `raise_exception`, `strftime_now`, Python's repr for dicts and lists,
/// markupsafe's escaping, `tojson` as `json.dumps`, an undefined value of length 0; at most `fuel`
/// steps.
fn chat_environment(fuel: u64) -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_fuel(Some(fuel));
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
    // `{{ a_dict }}` and `a_dict|string` print Python's repr, as Jinja2 does.
    env.add_filter("string", |v: minijinja::Value| -> String { py_str(&v) });
    // Jinja2's `escape`/`e` is markupsafe's: `"` → `&#34;` and `'` → `&#39;` (minijinja's own
    // writes `&quot;` and `&#x27;`); an already-safe value passes unchanged.
    let escape = |v: minijinja::Value| -> minijinja::Value {
        if v.is_safe() {
            return v;
        }
        minijinja::Value::from_safe_string(crate::template_ext::markupsafe_escape(&py_str(&v)))
    };
    env.add_filter("escape", escape);
    env.add_filter("e", escape);
    env.set_formatter(|out, state, value| {
        if matches!(
            value.kind(),
            minijinja::value::ValueKind::Map | minijinja::value::ValueKind::Seq
        ) {
            if let Ok(json) = serde_json::to_value(value) {
                return write!(out, "{}", crate::template_ext::py_repr(&json)).map_err(|_| {
                    minijinja::Error::new(minijinja::ErrorKind::WriteFailure, "formatting a value")
                });
            }
        }
        minijinja::escape_formatter(out, state, value)
    });
    env.add_filter(
        "tojson",
        |v: minijinja::Value,
         indent: Option<usize>,
         kw: minijinja::value::Kwargs|
         -> std::result::Result<String, minijinja::Error> {
            let indent = indent.or(kw.get::<Option<usize>>("indent")?);
            // Python's other json.dumps options: accepted, the defaults are what templates use.
            for k in ["ensure_ascii", "sort_keys", "separators"] {
                let _: Option<minijinja::Value> = kw.get(k)?;
            }
            let json = serde_json::to_value(&v).map_err(|e| {
                minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
            })?;
            Ok(crate::template_ext::py_json(&json, indent))
        },
    );
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
    env
}

/// Python's str(): a dict or list prints its repr.
fn py_str(v: &minijinja::Value) -> String {
    match v.kind() {
        minijinja::value::ValueKind::Map | minijinja::value::ValueKind::Seq => {
            serde_json::to_value(v)
                .map_or_else(|_| v.to_string(), |j| crate::template_ext::py_repr(&j))
        }
        _ => v.to_string(),
    }
}

/// As `render_chat_within`, with `tools` (undefined in the template when None, as transformers
/// leaves it).
pub fn render_chat_tools(
    template: &str,
    messages: &[Message],
    tools: Option<&serde_json::Value>,
    bos: Option<&str>,
    eos: Option<&str>,
    budget: RenderBudget,
) -> Result<String> {
    let mut env = chat_environment(budget.fuel);
    let template = crate::template_ext::generation_blocks(template);
    env.add_template_owned("chat", template).map_err(|e| Error::Template(e.to_string()))?;
    let tmpl = env.get_template("chat").map_err(|e| Error::Template(e.to_string()))?;
    let mut out = Capped { out: Vec::new(), max: budget.max_bytes, over: false };
    let ctx = minijinja::context! {
        messages => messages,
        add_generation_prompt => true,
        bos_token => bos.unwrap_or(""),
        eos_token => eos.unwrap_or(""),
    };
    let ctx = match tools {
        Some(t) => minijinja::context! { tools => minijinja::Value::from_serialize(t), ..ctx },
        None => ctx,
    };
    let rendered = tmpl.render_captured_to(ctx, &mut out).map(drop);
    match rendered {
        Ok(_) => String::from_utf8(out.out).map_err(|e| Error::Template(e.to_string())),
        Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
            Err(Error::TemplateBudget(format!(
            "rendering needs more than {} steps (the template loops far more than a chat needs)",
            budget.fuel
        )))
        }
        Err(_) if out.over => {
            Err(Error::TemplateBudget(format!("rendering exceeds {} bytes", budget.max_bytes)))
        }
        Err(e) => Err(Error::Template(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A template that loops far beyond its input stops at the output bound or the fuel, while
    /// rendering (the probe's bomb rendered hundreds of MB before any check); the import check
    /// refuses it, naming the template.
    #[test]
    fn templates_cannot_amplify() {
        let m = vec![Message::new("user", "Q?")];
        let bomb = "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx{% endfor %}{% endfor %}";
        let e = render_chat_within(bomb, &m, None, None, RenderBudget::bytes(1 << 20)).unwrap_err();
        assert!(e.to_string().contains("exceeds 1048576 bytes"), "{e}");
        let spin =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let e = render_chat(spin, &m, None, None).unwrap_err();
        assert!(e.to_string().contains("more than 50000000 steps"), "{e}");
        let tok = |t: &str| {
            let json = std::fs::read(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../tests/fixtures/models/tiny-llama/tokenizer.json"
            ));
            Tokenizer::from_json(&json.unwrap(), Some(t.into()), None, None).unwrap()
        };
        let e = tok(bomb).check_template().unwrap_err().to_string();
        assert!(e.starts_with("chat template: rendering one user turn: rendering exceeds"), "{e}");
        // Refusing a shape is the template's right (Gemma refuses a system turn, Mistral turns
        // that do not alternate); amplifying is not, whatever the shape.
        let one_turn_only = "{% if messages|length > 1 %}{{ raise_exception('one turn') }}{% endif %}{{ messages[0]['content'] }}";
        assert!(tok(one_turn_only).check_template().is_ok());
        let per_turn = "{% for m in messages %}{% if loop.index > 1 %}{% for i in range(100000) %}{{ m['content'] }}xxxxxxxxxxxx{% endfor %}{% endif %}{% endfor %}";
        let e = tok(per_turn).check_template().unwrap_err().to_string();
        assert!(e.contains("rendering a three-turn chat: rendering exceeds"), "{e}");
        assert!(tok("{{ messages[0]['content'] }}").check_template().is_ok());
    }

    #[test]
    fn renders_smollm_style_template() {
        let t = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nHi<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let m = vec![Message::new("user", "Q?")];
        let out = render_chat(t, &m, None, None).unwrap();
        assert_eq!(out, "<|im_start|>system\nHi<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn transformers_extensions_render() {
        let t = "{{ strftime_now('%Y') }}|{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}";
        let m = vec![Message::new("assistant", "ok")];
        let out = render_chat(t, &m, None, None).unwrap();
        let (year, rest) = out.split_once('|').unwrap();
        assert!(year.len() == 4 && year >= "2025", "{out}");
        assert_eq!(rest, "ok");
    }

    #[test]
    fn escape_is_markupsafe_s() {
        let t = "{% for m in messages %}{{ m.content|e }}|{{ m.content|escape|e }}{% endfor %}";
        let m = vec![Message::new("user", "<a href=\"x\">it's & more</a>")];
        let want = "&lt;a href=&#34;x&#34;&gt;it&#39;s &amp; more&lt;/a&gt;";
        assert_eq!(render_chat(t, &m, None, None).unwrap(), format!("{want}|{want}"));
    }

    #[test]
    fn raise_exception_surfaces() {
        let t = "{{ raise_exception('roles must alternate') }}";
        let e = render_chat(t, &[], None, None).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
    }
}
