//! Constrained decoding: a request's output format — any JSON object, a JSON schema, a regular
//! expression or a Lark grammar — compiled by llguidance over this model's own tokenizer, and
//! followed token by token. The coordinator holds one `Constraint` per constrained sequence: before
//! each step it computes the mask of tokens the format allows next (sent to the head worker, which
//! samples within it), after the step it advances by the chosen token, and tokens the format forces
//! (only one continuation possible) are emitted without sampling.

use crate::grammar_limits::{check_format, FormatLimits};
use layerstream_model::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    /// Any JSON object (OpenAI `json_object`).
    JsonObject,
    /// JSON valid under this schema (OpenAI `json_schema`).
    JsonSchema(Value),
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Text in this Lark grammar (llguidance's dialect, which may embed `%json{…}` schemas).
    Lark(String),
}

/// Our tokenizer seen through llguidance's `TokenizerEnv`: the bytes of every token (from the
/// tokenizer's own decoder description) and tokenization by the tokenizer we already run.
struct Env {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Grammars tokenize their literals; bytes that are not UTF-8 are greedy-matched instead.
        match std::str::from_utf8(s) {
            Ok(text) => self.tok.encode_with(text, false).unwrap_or_default(),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// The grammar compiler for one model: built once (its token trie and lexer slices take tens of
/// milliseconds), shared by every request.
pub struct Grammars {
    factory: ParserFactory,
    eos: Vec<u32>,
    vocab: usize,
    limits: FormatLimits,
}

impl Grammars {
    /// Builds the compiler over `tok`; `eos` are the model's end-of-sequence ids (the first is the
    /// one a finished format allows; every other is allowed exactly when it is).
    pub fn new(tok: Arc<Tokenizer>, eos: &[u32]) -> layerstream_model::Result<Self> {
        let bad =
            |e: String| layerstream_model::Error::Tokenizer(format!("constrained decoding: {e}"));
        let &first =
            eos.first().ok_or_else(|| bad("the model names no end-of-sequence token".into()))?;
        let mut words = tok.token_bytes().map_err(|e| bad(e.to_string()))?;
        let vocab = tok.vocab_size().max(words.len());
        words.resize(vocab, Vec::new());
        let info = TokRxInfo::new(vocab as u32, first);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| bad(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory, eos: eos.to_vec(), vocab, limits: FormatLimits::default() })
    }

    /// The same compiler under other format limits.
    pub fn with_limits(mut self, limits: FormatLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Tokens in the vocabulary the masks cover.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Compiles `format` for one request. JSON is written compactly as `json.dumps` does (`", "`
    /// and `": "`, no other whitespace) unless the schema sets llguidance's `x-guidance` options;
    /// the error names what cannot be compiled (an invalid schema, an unsupported keyword, a regex
    /// or grammar that does not parse, or the limit a format exceeds: `grammar_limits`).
    pub fn compile(&self, format: &Format) -> Result<Constraint, String> {
        check_format(format, &self.limits)?;
        let grammar = match format {
            Format::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"})))
            }
            Format::JsonSchema(s) => {
                if !s.is_object() && !s.is_boolean() {
                    return Err("the schema must be a JSON object".into());
                }
                TopLevelGrammar::from_json_schema(compact(s.clone()))
            }
            Format::Regex(r) => {
                regex_syntax::Parser::new().parse(r).map_err(|e| format!("the regex: {e}"))?;
                TopLevelGrammar::from_regex(r)
            }
            Format::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        // llguidance reports most problems as errors; a panic deep in a compiler is one too.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(grammar)
        }))
        .map_err(|_| "the grammar could not be compiled".to_string())?
        .map_err(|e| e.to_string())?;
        let mut c = Constraint { m: Matcher::new(Ok(parser)), eos: self.eos.clone() };
        // A format no token can start (an empty regex language, say) is refused up front.
        let mask = c.mask().map_err(|e| {
            let first = e.lines().next().unwrap_or_default().to_owned();
            format!("the format admits no token ({first})")
        })?;
        if mask.iter().all(|&w| w == 0) {
            return Err("the format admits no token".into());
        }
        Ok(c)
    }
}

/// `schema` with JSON written compactly as `json.dumps` does (`", "` and `": "`), unless it sets
/// llguidance's `x-guidance` options itself.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// `format` as the Lark rule `answer`, to be offered beside tool calls (`tools::call_or_answer_grammar`).
/// A Lark grammar has a `start` of its own and is refused, naming what can be combined.
pub fn answer_rule(format: &Format) -> Result<String, String> {
    Ok(match format {
        Format::JsonObject => format!("answer: %json {}", compact(json!({"type": "object"}))),
        Format::JsonSchema(s) if s.is_object() => format!("answer: %json {}", compact(s.clone())),
        Format::JsonSchema(_) => return Err("the schema must be a JSON object".into()),
        Format::Regex(r) => {
            regex_syntax::Parser::new().parse(r).map_err(|e| format!("the regex: {e}"))?;
            format!("answer: /{}/", r.replace('/', "\\/"))
        }
        Format::Lark(_) => {
            return Err("a grammar cannot be combined with tools under tool_choice auto (a JSON \
                        schema, json_object, a regex or a choice can; or set tool_choice none)"
                .into())
        }
    })
}

/// One sequence's position in its format.
#[derive(Clone)]
pub struct Constraint {
    m: Matcher,
    eos: Vec<u32>,
}

impl Constraint {
    /// The tokens allowed next: bit `t % 32` of word `t / 32` is set for an allowed token `t`
    /// (the end-of-sequence tokens only once the format is complete).
    pub fn mask(&mut self) -> Result<Vec<u32>, String> {
        let v = self.m.compute_mask_or_eos().map_err(|e| e.to_string())?;
        let mut words = v.as_slice().to_vec();
        let primary = v.is_allowed(self.eos[0]);
        for &e in &self.eos[1..] {
            let (w, b) = (e as usize / 32, e % 32);
            if let Some(word) = words.get_mut(w) {
                *word = (*word & !(1 << b)) | (u32::from(primary) << b);
            }
        }
        Ok(words)
    }

    /// Follows the chosen token (an end-of-sequence token ends the format).
    pub fn advance(&mut self, token: u32) -> Result<(), String> {
        let t = if self.eos.contains(&token) { self.eos[0] } else { token };
        self.m.consume_token(t).map_err(|e| e.to_string())
    }

    /// The tokens the format forces next (none when more than one continuation is possible),
    /// followed already.
    pub fn forced(&mut self) -> Vec<u32> {
        if self.m.is_stopped() {
            return Vec::new();
        }
        self.m.consume_ff_tokens()
    }

    /// The format is complete and nothing may follow (only end-of-sequence remains).
    pub fn finished(&self) -> bool {
        self.m.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Arc<Tokenizer> {
        let json = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/models/tiny-llama/tokenizer.json"
        ))
        .unwrap();
        Arc::new(Tokenizer::from_json(&json, None, None, None).unwrap())
    }

    /// Follows the format greedily choosing the allowed token that `pick` ranks first, returning
    /// the text (as a model whose preferences ignore the grammar would be steered).
    fn drive(g: &Grammars, t: &Tokenizer, f: &Format, pick: impl Fn(u32) -> i64) -> String {
        let mut c = g.compile(f).unwrap();
        let mut out = Vec::new();
        for _ in 0..200 {
            let forced = c.forced();
            out.extend(&forced);
            let mask = c.mask().unwrap();
            if mask[0] & 1 == 1 {
                break; // the format may end here: end it
            }
            let allowed =
                (0..g.vocab() as u32).filter(|&i| mask[i as usize / 32] >> (i % 32) & 1 == 1);
            let next = allowed.max_by_key(|&i| (pick(i), std::cmp::Reverse(i))).unwrap();
            c.advance(next).unwrap();
            out.push(next);
        }
        t.decode(&out, true).unwrap()
    }

    #[test]
    fn json_schema_outputs_parse_and_validate() {
        let t = tok();
        let g = Grammars::new(t.clone(), &[0]).unwrap();
        let schema = json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pet": {"enum": ["cat", "dog"]}},
            "required": ["name", "age", "pet"], "additionalProperties": false});
        // Two different "models": one prefers long tokens, one prefers high ids.
        for pick in [|i: u32| (i % 97) as i64, |i: u32| -((i % 13) as i64)] {
            let text = drive(&g, &t, &Format::JsonSchema(schema.clone()), pick);
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(v["name"].as_str().unwrap().chars().count() <= 6, "{text}");
            let age = v["age"].as_i64().unwrap();
            assert!((0..=120).contains(&age), "{text}");
            assert!(["cat", "dog"].contains(&v["pet"].as_str().unwrap()), "{text}");
            assert!(text.starts_with("{\"name\": \""), "compact as json.dumps: {text}");
        }
        let text = drive(&g, &t, &Format::Regex("(ab|cd){2}z".into()), |i| (i % 31) as i64);
        assert!(regex_syntax::Parser::new().parse("(ab|cd){2}z").is_ok());
        assert!(["ababz", "abcdz", "cdabz", "cdcdz"].contains(&text.as_str()), "{text}");
    }

    /// A required tool call: the grammar of every format yields text its parser reads back as a
    /// call of one of the functions, with arguments valid under its schema.
    #[test]
    fn required_tool_calls_parse_back() {
        use crate::tools::{call_grammar, functions, parse, ToolFormat};
        let t = tok();
        let g = Grammars::new(t.clone(), &[0]).unwrap();
        let funcs = functions(vec![
            ("get_weather".into(), String::new(), Some(json!({"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"], "additionalProperties": false}))),
            ("get_time".into(), String::new(), None),
        ])
        .unwrap();
        let refs: Vec<_> = funcs.iter().collect();
        for format in [ToolFormat::Hermes, ToolFormat::Llama3Json, ToolFormat::Mistral] {
            for parallel in [false, true] {
                let lark = call_grammar(format, &refs, parallel);
                let text = drive(&g, &t, &Format::Lark(lark.clone()), |i| (i % 89) as i64);
                let (_, calls) =
                    parse(format, &text).unwrap_or_else(|| panic!("{format:?}: {text:?}"));
                assert!(!calls.is_empty() && (parallel || calls.len() == 1), "{text}");
                for c in calls {
                    match c.name.as_str() {
                        "get_weather" => {
                            assert!(
                                ["c", "f"].contains(&c.arguments["unit"].as_str().unwrap()),
                                "{text}"
                            )
                        }
                        "get_time" => assert!(c.arguments.is_object()),
                        other => panic!("{other}"),
                    }
                }
            }
        }
    }

    /// Tools beside a response format under `auto`: every sentence is a call that parses back or
    /// an answer in the format; a regex answer's `/` survives the embedding; a grammar is refused.
    #[test]
    fn a_call_or_an_answer_in_the_format() {
        use crate::tools::{call_or_answer_grammar, functions, parse, ToolFormat};
        let t = tok();
        let g = Grammars::new(t.clone(), &[0]).unwrap();
        let tz = json!({"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}},
            "required": ["tz"], "additionalProperties": false});
        let funcs = functions(vec![("get_time".into(), String::new(), Some(tz))]).unwrap();
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer",
            "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": false});
        let answer = answer_rule(&Format::JsonSchema(schema)).unwrap();
        let lark = call_or_answer_grammar(ToolFormat::Hermes, &[&funcs[0]], false, &answer);
        let (mut calls, mut answers) = (0, 0);
        for k in [89, 7, 31, 113, 5, 61] {
            let text = drive(&g, &t, &Format::Lark(lark.clone()), |i| (i % k) as i64);
            match parse(ToolFormat::Hermes, &text) {
                Some((_, c)) => {
                    assert_eq!(c.len(), 1, "{text}");
                    calls += 1;
                }
                None => {
                    let v: Value =
                        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                    assert!((0..=9).contains(&v["n"].as_i64().unwrap()), "{text}");
                    answers += 1;
                }
            }
        }
        assert!(calls > 0 && answers > 0, "both ways are open: {calls} calls, {answers} answers");
        let slash = answer_rule(&Format::Regex("a/b".into())).unwrap();
        let lark = call_or_answer_grammar(ToolFormat::Hermes, &[&funcs[0]], false, &slash);
        let text = drive(&g, &t, &Format::Lark(lark), |i| -((i % 13) as i64));
        assert!(text == "a/b" || parse(ToolFormat::Hermes, &text).is_some(), "{text}");
        assert!(answer_rule(&Format::Lark("start: \"x\"".into()))
            .unwrap_err()
            .contains("tool_choice"));
    }

    /// pydantic writes nested models as `$defs` with `#/$defs/…` references: embedded in the call
    /// grammar they still resolve (the probe got "Reference segment '$defs' not found").
    #[test]
    fn tool_parameters_with_defs_compile() {
        use crate::tools::{call_grammar, functions, parse, ToolFormat};
        let t = tok();
        let g = Grammars::new(t.clone(), &[0]).unwrap();
        let params = json!({"type": "object", "$defs": {"City": {"type": "object",
            "properties": {"name": {"type": "string", "maxLength": 5}}, "required": ["name"],
            "additionalProperties": false}},
            "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
            "additionalProperties": false});
        let funcs = functions(vec![("pick".into(), String::new(), Some(params))]).unwrap();
        let lark = call_grammar(ToolFormat::Hermes, &funcs.iter().collect::<Vec<_>>(), false);
        let text = drive(&g, &t, &Format::Lark(lark), |i| (i % 89) as i64);
        let (_, calls) = parse(ToolFormat::Hermes, &text).unwrap_or_else(|| panic!("{text:?}"));
        assert!(calls[0].arguments["city"]["name"].is_string(), "{text}");
    }

    /// The probe's crashing formats are refused by their limits before llguidance sees them.
    #[test]
    fn formats_over_the_limits_are_refused() {
        let g = Grammars::new(tok(), &[0]).unwrap();
        let mut lark = String::from("start: r0\n");
        for i in 0..700 {
            lark.push_str(&format!("r{i}: r{}\n", i + 1));
        }
        lark.push_str("r700: \"end\"\n");
        let e = g.compile(&Format::Lark(lark)).err().unwrap();
        assert!(e.contains("chain of rules") && e.contains("limit of 64"), "{e}");
    }

    #[test]
    fn bad_formats_are_named() {
        let g = Grammars::new(tok(), &[0]).unwrap();
        let e = g.compile(&Format::JsonSchema(json!({"type": "strnig"}))).err().unwrap();
        assert!(e.contains("strnig"), "{e}");
        let e = g.compile(&Format::JsonSchema(json!([1]))).err().unwrap();
        assert!(e.contains("JSON object"), "{e}");
        let e = g.compile(&Format::Regex("(ab".into())).err().unwrap();
        assert!(e.contains("regex"), "{e}");
        let e = g.compile(&Format::Lark("start: foo(".into())).err().unwrap();
        assert!(!e.is_empty());
        let e = g
            .compile(&Format::JsonSchema(
                json!({"type": "object", "if": {"required": ["a"]}, "then": {}}),
            ))
            .err()
            .unwrap();
        assert!(e.contains("if"), "{e}");
        let e = g.compile(&Format::Lark("start: a\na: b\nb: a".into())).err().unwrap();
        assert!(e.starts_with("the format admits no token"), "{e}");
    }
}
