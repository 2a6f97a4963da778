//! Tool calling: OpenAI `tools` checked and handed to the chat template, the model's answer parsed
//! back into calls in the format its template teaches (Hermes/Qwen `<tool_call>` tags, Llama 3.x
//! JSON, Mistral `[TOOL_CALLS]`), and the grammar that forces a valid call when a request requires
//! one. A template that does not take tools (SmolLM2's) is given them in a system message that asks
//! for Hermes tags, as llama-server does for templates without native tool support.

use layerstream_model::Message;
use serde_json::{json, Value};

/// How a model writes tool calls, chosen from its chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` (Hermes, Qwen2.5, Qwen3).
    Hermes,
    /// `{"name": …, "parameters": {…}}`, optionally after `<|python_tag|>` (Llama 3.1–3.3).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (Mistral).
    Mistral,
    /// The template ignores tools: they are described in a system message, calls are Hermes tags.
    Generic,
}

impl ToolFormat {
    /// The format `template` teaches.
    pub fn of_template(template: &str) -> Self {
        if !template.contains("tools") {
            ToolFormat::Generic
        } else if template.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if template.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template.contains("<|python_tag|>") || template.contains("ipython") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }

    /// The key a call's arguments go under.
    fn args_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        }
    }
}

/// One function of a request's `tools`.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub description: String,
    /// A JSON schema (an object schema; `{"type": "object"}` when the tool gave none).
    pub parameters: Value,
}

/// A call parsed from the model's output.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    /// A JSON object.
    pub arguments: Value,
}

/// Checks `(name, description, parameters)` triples: names of 1–64 letters, digits, `_`, `-` or
/// `.`, each once; parameters a JSON object schema.
pub fn functions(tools: Vec<(String, String, Option<Value>)>) -> Result<Vec<Function>, String> {
    let mut out: Vec<Function> = Vec::with_capacity(tools.len());
    for (i, (name, description, parameters)) in tools.into_iter().enumerate() {
        let ok = (1..=64).contains(&name.len())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
        if !ok {
            return Err(format!(
                "tools[{i}]: the name {name:?} must be 1-64 letters, digits, '_', '-' or '.'"
            ));
        }
        if out.iter().any(|f| f.name == name) {
            return Err(format!("tools[{i}]: the name {name:?} is used twice"));
        }
        let parameters = parameters.unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        if !parameters.is_object() {
            return Err(format!("tools[{i}]: parameters must be a JSON schema object"));
        }
        out.push(Function { name, description, parameters });
    }
    Ok(out)
}

/// The `tools` list a template receives (OpenAI's shape, as transformers takes it).
pub fn template_tools(funcs: &[Function]) -> Value {
    Value::Array(
        funcs
            .iter()
            .map(|f| {
                json!({"type": "function", "function": {
                    "name": f.name, "description": f.description, "parameters": f.parameters}})
            })
            .collect(),
    )
}

/// The system message that teaches a template without tools to call them (Hermes's prompt).
fn generic_system(funcs: &[Function]) -> String {
    let mut s = String::from(
        "You are a function calling AI model. You are provided with function signatures within \
         <tools></tools> XML tags. You may call one or more functions to assist with the user \
         query. Don't make assumptions about what values to plug into functions. Here are the \
         available tools: <tools>",
    );
    for t in template_tools(funcs).as_array().into_iter().flatten() {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str(
        "\n</tools>\nFor each function call return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n{\"name\": \
         <function-name>, \"arguments\": <args-dict>}\n</tool_call>",
    );
    s
}

/// The messages (and `tools`) the template renders. With a template that takes tools, they go
/// as they are; otherwise the tools are described in the system message, an assistant's calls
/// become `<tool_call>` text and a tool's result is wrapped in `<tool_response>` tags.
pub fn prepare(
    format: ToolFormat,
    mut messages: Vec<Message>,
    funcs: &[Function],
) -> (Vec<Message>, Option<Value>) {
    if format != ToolFormat::Generic {
        let tools = (!funcs.is_empty()).then(|| template_tools(funcs));
        return (messages, tools);
    }
    for m in &mut messages {
        if let Some(calls) = m.tool_calls.take() {
            for c in calls.as_array().into_iter().flatten() {
                let f = &c["function"];
                let call = json!({"name": f["name"], "arguments": f["arguments"]});
                if !m.content.is_empty() {
                    m.content.push('\n');
                }
                m.content.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
            }
        }
        if m.role == "tool" {
            m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
        }
    }
    if !funcs.is_empty() {
        let sys = generic_system(funcs);
        match messages.first_mut() {
            Some(m) if m.role == "system" => m.content = format!("{}\n\n{sys}", m.content),
            _ => messages.insert(0, Message::new("system", &sys)),
        }
    }
    (messages, None)
}

/// How a request's output is read back for tool calls: the template's format, whether at most one
/// call is kept (`parallel_tool_calls: false`, or a named function), and the functions offered (an
/// untagged Llama 3 "call" of another — a JSON answer whose first key is `name` — is text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    pub format: ToolFormat,
    pub one: bool,
    pub names: Vec<String>,
}

/// A Lark grammar (llguidance's dialect) whose sentences are valid calls of `funcs` in `format`:
/// one call, or with `parallel` one or more.
pub fn call_grammar(format: ToolFormat, funcs: &[&Function], parallel: bool) -> String {
    format!("start: calls\n{}", call_rules(format, funcs, parallel))
}

/// As `call_grammar`, or instead of calls a text answer: the rule `answer` that `answer_rules`
/// defines (a response format offered beside tools under `tool_choice` auto).
pub fn call_or_answer_grammar(
    format: ToolFormat,
    funcs: &[&Function],
    parallel: bool,
    answer_rules: &str,
) -> String {
    format!("start: calls | answer\n{answer_rules}\n{}", call_rules(format, funcs, parallel))
}

/// The Lark rules of `call_grammar` without `start`: `calls` derives the calls.
fn call_rules(format: ToolFormat, funcs: &[&Function], parallel: bool) -> String {
    let key = format.args_key();
    let alts: Vec<String> = funcs
        .iter()
        .enumerate()
        .map(|(i, f)| {
            // The parameters sit under properties.<key> of the call's schema: their local
            // references (pydantic's `#/$defs/…`) are made to point there.
            let params = relocate_refs(&f.parameters, &format!("#/properties/{key}"));
            let schema = json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, key: params},
                "required": ["name", key],
                "additionalProperties": false,
                "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
            });
            format!("f{i}: %json {schema}\n")
        })
        .collect();
    let obj = (0..funcs.len()).map(|i| format!("f{i}")).collect::<Vec<_>>().join(" | ");
    let (calls, call) = match format {
        ToolFormat::Hermes | ToolFormat::Generic => (
            if parallel { "calls: call (\"\\n\" call)*" } else { "calls: call" },
            "call: \"<tool_call>\\n\" obj \"\\n</tool_call>\"",
        ),
        ToolFormat::Llama3Json => {
            (if parallel { "calls: obj (\"; \" obj)*" } else { "calls: obj" }, "")
        }
        ToolFormat::Mistral => (
            if parallel {
                "calls: \"[TOOL_CALLS][\" obj (\", \" obj)* \"]\""
            } else {
                "calls: \"[TOOL_CALLS][\" obj \"]\""
            },
            "",
        ),
    };
    format!("{calls}\n{call}\nobj: {obj}\n{}", alts.concat())
}

/// `schema` with every local `$ref` (`#…`) rewritten to point below `base`, where it will be
/// embedded (refs to other documents are left alone).
fn relocate_refs(schema: &Value, base: &str) -> Value {
    match schema {
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, v)| match (k.as_str(), v) {
                    ("$ref", Value::String(r)) if r.starts_with('#') => {
                        let rest = r[1..].trim_start_matches('/');
                        let to = if rest.is_empty() {
                            base.to_owned()
                        } else {
                            format!("{base}/{rest}")
                        };
                        (k.clone(), Value::String(to))
                    }
                    _ => (k.clone(), relocate_refs(v, base)),
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(|v| relocate_refs(v, base)).collect()),
        other => other.clone(),
    }
}

/// One call from a JSON object `{"name": …, "arguments"|"parameters": {…}}`.
fn call_of(v: &Value) -> Option<Call> {
    let name = v.get("name")?.as_str()?.to_owned();
    let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or(json!({}));
    // Some models write the arguments as a JSON string.
    let arguments = match args {
        Value::String(s) => serde_json::from_str(&s).ok()?,
        other => other,
    };
    arguments.is_object().then_some(Call { name, arguments })
}

/// The calls in `text` (the output decoded with its special tokens) and the text around them;
/// None when it holds no call or a call that does not parse (the output is then plain text).
pub fn parse(format: ToolFormat, text: &str) -> Option<(String, Vec<Call>)> {
    match format {
        ToolFormat::Hermes | ToolFormat::Generic => {
            let first = text.find("<tool_call>")?;
            let mut calls = Vec::new();
            let mut rest = &text[first..];
            let mut after = String::new();
            while let Some(start) = rest.find("<tool_call>") {
                after.push_str(rest[..start].trim());
                // One JSON value (its strings may hold anything, `</tool_call>` included), then
                // the closing tag (or the end of the output).
                let body = rest[start + "<tool_call>".len()..].trim_start();
                let mut values = serde_json::Deserializer::from_str(body).into_iter::<Value>();
                let v = values.next()?.ok()?;
                let tail = body[values.byte_offset()..].trim_start();
                rest = match tail.strip_prefix("</tool_call>") {
                    Some(next) => next,
                    None if tail.is_empty() => "",
                    None => return None,
                };
                calls.push(call_of(&v)?);
            }
            after.push_str(rest.trim());
            let mut content = text[..first].trim().to_owned();
            if !after.is_empty() {
                content.push_str(&after);
            }
            Some((content, calls))
        }
        ToolFormat::Llama3Json => {
            let t = text.trim();
            let t = t.strip_prefix("<|python_tag|>").unwrap_or(t).trim();
            if !t.starts_with('{') {
                return None;
            }
            let calls = t
                .split("; ")
                .map(|part| call_of(&serde_json::from_str(part.trim()).ok()?))
                .collect::<Option<Vec<_>>>()?;
            Some((String::new(), calls))
        }
        ToolFormat::Mistral => {
            let at = text.find("[TOOL_CALLS]")?;
            let body = text[at + "[TOOL_CALLS]".len()..].trim();
            let calls = if body.starts_with('[') {
                let v: Value = serde_json::from_str(body).ok()?;
                v.as_array()?.iter().map(call_of).collect::<Option<Vec<_>>>()?
            } else {
                // Newer templates: `name[ARGS]{…}` per call.
                let mut calls = Vec::new();
                for part in body.split("[TOOL_CALLS]") {
                    let (name, args) = part.split_once("[ARGS]")?;
                    let arguments: Value = serde_json::from_str(args.trim()).ok()?;
                    calls.push(Call { name: name.trim().to_owned(), arguments });
                }
                calls
            };
            Some((text[..at].trim().to_owned(), calls))
        }
    }
}

/// A call as it goes out: its name and its arguments as text.
#[derive(Debug, Clone, PartialEq)]
pub struct CallText {
    pub name: String,
    pub arguments: String,
}

impl From<Call> for CallText {
    fn from(c: Call) -> Self {
        CallText { name: c.name, arguments: c.arguments.to_string() }
    }
}

/// As `parse`, for an output that stopped inside a call (cut by its length, or malformed): the
/// calls it holds, the last with the arguments written so far (as OpenAI returns a cut call), and
/// the text before the first call's marker — never the markup itself. A call whose name was not
/// written yet is left out. None when the output holds no call marker (it is plain text). A
/// Llama 3 output counts as a call when it starts with `<|python_tag|>` or `{"name"`.
pub fn parse_cut(format: ToolFormat, text: &str) -> Option<(String, Vec<CallText>)> {
    let (content, mut rest) = match format {
        ToolFormat::Hermes | ToolFormat::Generic => {
            let at = text.find("<tool_call>")?;
            (text[..at].trim(), &text[at..])
        }
        ToolFormat::Mistral => {
            let at = text.find("[TOOL_CALLS]")?;
            (text[..at].trim(), &text[at + "[TOOL_CALLS]".len()..])
        }
        ToolFormat::Llama3Json => {
            let t = text.trim_start();
            let tagged = t.strip_prefix("<|python_tag|>");
            let body = tagged.unwrap_or(t).trim_start();
            let named =
                body.strip_prefix('{').is_some_and(|b| b.trim_start().starts_with("\"name\""));
            if tagged.is_none() && !named {
                return None;
            }
            ("", body)
        }
    };
    let mut calls = Vec::new();
    loop {
        rest = skip_separators(rest);
        if rest.is_empty() {
            break;
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        match values.next() {
            Some(Ok(v)) => match call_of(&v) {
                Some(c) => calls.push(CallText::from(c)),
                None => break,
            },
            _ => {
                calls.extend(partial_call(rest));
                break;
            }
        }
        rest = &rest[values.byte_offset()..];
    }
    Some((content.to_owned(), calls))
}

/// `s` past the whitespace, tags and punctuation between calls.
fn skip_separators(mut s: &str) -> &str {
    loop {
        let t = s.trim_start();
        let next = ["<tool_call>", "</tool_call>", "[", "]", ",", ";"]
            .iter()
            .find_map(|m| t.strip_prefix(m));
        match next {
            Some(n) => s = n,
            None => return t,
        }
    }
}

/// A call object cut short: its name (written whole) and its arguments so far.
fn partial_call(s: &str) -> Option<CallText> {
    let s = s.strip_prefix('{')?.trim_start().strip_prefix("\"name\"")?;
    let s = s.trim_start().strip_prefix(':')?.trim_start();
    let mut names = serde_json::Deserializer::from_str(s).into_iter::<String>();
    let name = names.next()?.ok()?;
    let s = s[names.byte_offset()..].trim_start().strip_prefix(',').unwrap_or("").trim_start();
    let args = ["\"arguments\"", "\"parameters\""]
        .iter()
        .find_map(|k| s.strip_prefix(k))
        .and_then(|a| a.trim_start().strip_prefix(':'))
        .map_or("", str::trim_start);
    // Whole arguments (only the call's closing brace was cut) go out as they would have.
    let mut values = serde_json::Deserializer::from_str(args).into_iter::<Value>();
    let arguments = match values.next() {
        Some(Ok(Value::String(text))) => text,
        Some(Ok(v)) => v.to_string(),
        _ => args.trim_end().to_owned(),
    };
    Some(CallText { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_come_from_the_template() {
        assert_eq!(ToolFormat::of_template("{{ messages }}"), ToolFormat::Generic);
        assert_eq!(
            ToolFormat::of_template("{% if tools %}<tool_call>{% endif %}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::of_template("{% if tools %}[TOOL_CALLS]{% endif %}"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::of_template("{% if tools %}<|python_tag|>{% endif %}"),
            ToolFormat::Llama3Json
        );
    }

    #[test]
    fn calls_parse_in_each_format() {
        let (c, calls) = parse(
            ToolFormat::Hermes,
            "Let me look.\n<tool_call>\n{\"name\": \"get\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"put\", \"arguments\": \"{\\\"b\\\": 2}\"}\n</tool_call>",
        )
        .unwrap();
        assert_eq!(c, "Let me look.");
        assert_eq!(calls[0], Call { name: "get".into(), arguments: json!({"a": 1}) });
        assert_eq!(calls[1], Call { name: "put".into(), arguments: json!({"b": 2}) });
        assert!(parse(ToolFormat::Hermes, "no call here").is_none());
        let tricky = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"s\": \"x</tool_call>\"}}\n</tool_call>";
        assert_eq!(
            parse(ToolFormat::Hermes, tricky).unwrap().1[0].arguments,
            json!({"s": "x</tool_call>"})
        );
        let cut =
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"na";
        assert_eq!(parse_cut(ToolFormat::Hermes, cut).unwrap().1.len(), 1);
        assert!(
            parse(ToolFormat::Hermes, "<tool_call>{\"name\": \"x\", ").is_none(),
            "malformed: text"
        );
        let (_, calls) = parse(
            ToolFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"w\", \"parameters\": {\"city\": \"Paris\"}}",
        )
        .unwrap();
        assert_eq!(calls, vec![Call { name: "w".into(), arguments: json!({"city": "Paris"}) }]);
        assert!(parse(ToolFormat::Llama3Json, "Paris is sunny.").is_none());
        let (_, calls) =
            parse(ToolFormat::Mistral, "[TOOL_CALLS][{\"name\": \"w\", \"arguments\": {}}]")
                .unwrap();
        assert_eq!(calls[0].name, "w");
        let (_, calls) = parse(ToolFormat::Mistral, "[TOOL_CALLS]w[ARGS]{\"x\": 1}").unwrap();
        assert_eq!(calls[0].arguments, json!({"x": 1}));
    }

    /// A call cut short comes back as a call with the arguments written so far; the markup never
    /// reaches the text.
    #[test]
    fn cut_calls_keep_their_arguments_so_far() {
        let call = |n: &str, a: &str| CallText { name: n.into(), arguments: a.into() };
        let text = "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"city\": \"Par";
        let (content, calls) = parse_cut(ToolFormat::Hermes, text).unwrap();
        assert_eq!(content, "Sure.");
        assert_eq!(calls, vec![call("a", "{\"x\":1}"), call("b", "{\"city\": \"Par")]);
        let (content, calls) = parse_cut(ToolFormat::Generic, "Hi <tool_call>\n{\"nam").unwrap();
        assert_eq!((content.as_str(), calls.len()), ("Hi", 0), "no name yet: no call, no tags");
        let whole_args = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"y\": [1, 2]}";
        assert_eq!(
            parse_cut(ToolFormat::Hermes, whole_args).unwrap().1,
            [call("a", "{\"y\":[1,2]}")]
        );
        assert!(parse_cut(ToolFormat::Hermes, "plain text").is_none());
        let m = "[TOOL_CALLS][{\"name\": \"w\", \"arguments\": {}}, {\"name\": \"v\", \"arguments\": {\"q";
        assert_eq!(
            parse_cut(ToolFormat::Mistral, m).unwrap().1,
            [call("w", "{}"), call("v", "{\"q")]
        );
        let l = "<|python_tag|>{\"name\": \"w\", \"parameters\": {\"c\": ";
        assert_eq!(parse_cut(ToolFormat::Llama3Json, l).unwrap().1, [call("w", "{\"c\":")]);
        assert!(
            parse_cut(ToolFormat::Llama3Json, "{\"city\": \"Paris\"}").is_none(),
            "a JSON answer"
        );
    }

    #[test]
    fn a_call_or_an_answer() {
        let funcs = functions(vec![("w".into(), String::new(), None)]).unwrap();
        let g = call_or_answer_grammar(ToolFormat::Hermes, &[&funcs[0]], false, "answer: /[a-z]+/");
        assert!(g.starts_with("start: calls | answer\nanswer: /[a-z]+/\ncalls: call\n"), "{g}");
        assert!(call_grammar(ToolFormat::Mistral, &[&funcs[0]], true).contains("(\", \" obj)*"));
    }

    #[test]
    fn tool_lists_are_checked() {
        let f = |n: &str| (n.to_owned(), String::new(), None);
        assert!(functions(vec![f("a"), f("b_c-1.x")]).is_ok());
        assert!(functions(vec![f("a"), f("a")]).unwrap_err().contains("twice"));
        assert!(functions(vec![f("")]).is_err());
        assert!(functions(vec![f("a b")]).is_err());
        let e = functions(vec![("a".into(), String::new(), Some(json!([1])))]).unwrap_err();
        assert!(e.contains("parameters"), "{e}");
    }

    #[test]
    fn a_template_without_tools_gets_them_in_the_system_message() {
        let funcs = functions(vec![("w".into(), "weather".into(), None)]).unwrap();
        let mut call = Message::new("assistant", "");
        call.tool_calls = Some(
            json!([{"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"x": 1}}}]),
        );
        let msgs = vec![Message::new("user", "hi"), call, Message::new("tool", "sunny")];
        let (m, tools) = prepare(ToolFormat::Generic, msgs.clone(), &funcs);
        assert!(tools.is_none());
        assert_eq!(m[0].role, "system");
        assert!(m[0].content.contains("\"name\":\"w\""), "{}", m[0].content);
        assert_eq!(
            m[2].content,
            "<tool_call>\n{\"name\":\"w\",\"arguments\":{\"x\":1}}\n</tool_call>"
        );
        assert_eq!(m[3].content, "<tool_response>\nsunny\n</tool_response>");
        let (m, tools) = prepare(ToolFormat::Hermes, msgs.clone(), &funcs);
        assert_eq!(m, msgs);
        assert_eq!(tools.unwrap()[0]["function"]["name"], "w");
    }
}
