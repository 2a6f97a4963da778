//! Bounds on a request's output format, checked before anything compiles it. A grammar compiler
//! recurses through rule chains and `$ref` chains and spends CPU per alternative, so a few
//! kilobytes of hostile format (700 rules each naming the next, 300 `$ref`s each nesting an object,
//! 50,000 alternatives) could overflow a thread's stack or burn seconds of CPU. These checks are
//! pure, iterative where the input sets the depth, and name the limit a format exceeds.

use crate::grammar::Format;
use serde_json::Value;
use std::collections::{HashMap, HashSet};

/// What a format may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FormatLimits {
    /// Bytes of schema, regex or grammar text.
    pub max_bytes: usize,
    /// Nesting: schema levels (following `$ref`s), a Lark rule chain, parentheses, regex groups.
    pub max_depth: usize,
    /// Lark rules (and terminals) defined.
    pub max_rules: usize,
    /// Alternatives in all: Lark `|`s, schema `anyOf`/`oneOf` entries and `enum` values.
    pub max_alternatives: usize,
}

impl Default for FormatLimits {
    /// Generous for real schemas and grammars (agents' tool sets, pydantic models, SQL-sized Lark
    /// grammars); far below what takes a compiler seconds or a 64 MiB stack.
    fn default() -> Self {
        FormatLimits {
            max_bytes: 256 << 10,
            max_depth: 64,
            max_rules: 1000,
            max_alternatives: 2000,
        }
    }
}

/// Why a format was refused: the limit and what the format had.
fn over(what: &str, had: usize, most: usize) -> String {
    format!("{what} {had} exceeds the limit of {most}")
}

/// Checks `format` against `limits`; the error names the limit exceeded.
pub fn check_format(format: &Format, limits: &FormatLimits) -> Result<(), String> {
    match format {
        Format::JsonObject => Ok(()),
        Format::JsonSchema(s) => check_schema(s, limits),
        Format::Regex(r) => check_regex(r, limits),
        Format::Lark(g) => check_lark(g, limits),
    }
}

/// A regular expression: its length and group nesting (the parser's own nest limit).
pub fn check_regex(r: &str, limits: &FormatLimits) -> Result<(), String> {
    if r.len() > limits.max_bytes {
        return Err(over("the regex's length in bytes", r.len(), limits.max_bytes));
    }
    regex_syntax::ParserBuilder::new()
        .nest_limit(limits.max_depth as u32)
        .build()
        .parse(r)
        .map(drop)
        .map_err(|e| format!("the regex (nesting limit {}): {e}", limits.max_depth))
}

/// A JSON schema: its size, its depth with every `$ref` followed (a reference back into the
/// current path is recursion, which compilers expand lazily, and adds nothing), and its
/// alternatives.
pub fn check_schema(schema: &Value, limits: &FormatLimits) -> Result<(), String> {
    let bytes = serde_json::to_string(schema).map_or(0, |s| s.len());
    if bytes > limits.max_bytes {
        return Err(over("the schema's size in bytes", bytes, limits.max_bytes));
    }
    let alternatives = count_alternatives(schema);
    if alternatives > limits.max_alternatives {
        return Err(over(
            "the schema's alternatives (anyOf/oneOf entries and enum values)",
            alternatives,
            limits.max_alternatives,
        ));
    }
    let mut walk = SchemaWalk { root: schema, most: limits.max_depth, path: Vec::new() };
    walk.depth(schema, 1).map(drop)
}

/// anyOf/oneOf entries and enum values anywhere in `v` (iteratively: serde_json bounds the
/// nesting of a parsed value, not of one built in code).
fn count_alternatives(v: &Value) -> usize {
    let (mut n, mut stack) = (0, vec![v]);
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(o) => {
                for key in ["anyOf", "oneOf", "enum"] {
                    n += o.get(key).and_then(Value::as_array).map_or(0, Vec::len);
                }
                stack.extend(o.values());
            }
            Value::Array(a) => stack.extend(a),
            _ => {}
        }
    }
    n
}

/// Depth of a schema with references followed; stops as soon as the limit is passed, so it
/// recurses at most `most` levels (plus the value's own nesting, which serde_json bounds).
struct SchemaWalk<'a> {
    root: &'a Value,
    most: usize,
    /// The references being expanded (a reference already on it is recursion).
    path: Vec<&'a str>,
}

impl<'a> SchemaWalk<'a> {
    fn depth(&mut self, v: &'a Value, level: usize) -> Result<usize, String> {
        if level > self.most {
            return Err(over("the schema's nesting (with $refs followed)", level, self.most));
        }
        let Value::Object(o) = v else {
            return Ok(level - 1);
        };
        let mut deepest = level;
        if let Some(r) = o.get("$ref").and_then(Value::as_str) {
            if !self.path.contains(&r) {
                if let Some(target) = resolve_ref(self.root, r) {
                    self.path.push(r);
                    let d = self.depth(target, level + 1);
                    self.path.pop();
                    deepest = deepest.max(d?);
                }
            }
        }
        for (key, child) in o {
            let nested: Vec<&'a Value> = match key.as_str() {
                "properties" | "patternProperties" | "dependentSchemas" => {
                    child.as_object().map(|m| m.values().collect()).unwrap_or_default()
                }
                "items"
                | "additionalProperties"
                | "not"
                | "if"
                | "then"
                | "else"
                | "contains"
                | "propertyNames"
                | "unevaluatedItems"
                | "unevaluatedProperties" => match child {
                    Value::Array(a) => a.iter().collect(),
                    other => vec![other],
                },
                "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                    child.as_array().map(|a| a.iter().collect()).unwrap_or_default()
                }
                _ => Vec::new(),
            };
            for n in nested {
                deepest = deepest.max(self.depth(n, level + 1)?);
            }
        }
        Ok(deepest)
    }
}

/// The value a local reference (`#`, `#/a/b`, JSON-pointer escapes) names in `root`.
fn resolve_ref<'a>(root: &'a Value, r: &str) -> Option<&'a Value> {
    let pointer = r.strip_prefix('#')?;
    if pointer.is_empty() {
        return Some(root);
    }
    root.pointer(pointer)
}

/// A Lark grammar: its size, rules, alternatives, bracket nesting, the longest chain of rules
/// naming rules, and every embedded `%json` schema.
pub fn check_lark(g: &str, limits: &FormatLimits) -> Result<(), String> {
    if g.len() > limits.max_bytes {
        return Err(over("the grammar's length in bytes", g.len(), limits.max_bytes));
    }
    let scan = scan_lark(g)?;
    if scan.alternatives > limits.max_alternatives {
        return Err(over(
            "the grammar's alternatives (|)",
            scan.alternatives,
            limits.max_alternatives,
        ));
    }
    if scan.nesting > limits.max_depth {
        return Err(over("the grammar's bracket nesting", scan.nesting, limits.max_depth));
    }
    if scan.rules.len() > limits.max_rules {
        return Err(over("the grammar's rules", scan.rules.len(), limits.max_rules));
    }
    let chain = longest_chain(&scan.rules);
    if chain > limits.max_depth {
        return Err(over(
            "the grammar's chain of rules (each naming the next)",
            chain,
            limits.max_depth,
        ));
    }
    for schema in &scan.schemas {
        check_schema(schema, limits).map_err(|e| format!("a %json in the grammar: {e}"))?;
    }
    Ok(())
}

/// What one pass over a Lark grammar finds.
#[derive(Default)]
struct LarkScan {
    /// Rule name → the names its body mentions (in order of definition).
    rules: Vec<(String, Vec<String>)>,
    alternatives: usize,
    nesting: usize,
    schemas: Vec<Value>,
}

/// Reads a Lark grammar token by token: strings and regexes skipped, `%json {…}` parsed as JSON,
/// a definition is a name at the start of a line followed by `:` (or `.priority:`).
fn scan_lark(g: &str) -> Result<LarkScan, String> {
    let mut s = LarkScan::default();
    let b = g.as_bytes();
    let (mut i, mut depth, mut line_start) = (0, 0usize, true);
    while i < b.len() {
        let c = b[i];
        if c == b' ' || c == b'\t' || c == b'\r' {
            i += 1;
            continue;
        }
        match c {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'\n' => {
                line_start = true;
                i += 1;
                continue;
            }
            b'"' | b'/' => i = skip_quoted(b, i),
            b'|' => {
                s.alternatives += 1;
                i += 1;
            }
            b'(' | b'[' => {
                depth += 1;
                s.nesting = s.nesting.max(depth);
                i += 1;
            }
            b')' | b']' => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            b'%' if g[i..].starts_with("%json") => {
                let rest = &g[i + 5..];
                let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                match it.next() {
                    Some(Ok(v)) => {
                        s.schemas.push(v);
                        i += 5 + it.byte_offset();
                    }
                    _ => return Err("a %json in the grammar is not followed by JSON".into()),
                }
            }
            c if c == b'_' || c == b'?' || c.is_ascii_alphabetic() => {
                let start = i;
                i += 1;
                while i < b.len() && (b[i] == b'_' || b[i].is_ascii_alphanumeric()) {
                    i += 1;
                }
                let name = g[start..i].trim_start_matches('?').to_owned();
                if name.is_empty() {
                    // a `?` quantifier
                } else if line_start && is_definition(&b[i..]) {
                    s.rules.push((name, Vec::new()));
                } else if let Some((_, body)) = s.rules.last_mut() {
                    body.push(name);
                }
            }
            _ => i += 1,
        }
        line_start = false;
    }
    Ok(s)
}

/// After a name: `:` or `.N:` (a priority), with spaces allowed.
fn is_definition(rest: &[u8]) -> bool {
    let mut j = 0;
    while j < rest.len() && rest[j] == b' ' {
        j += 1;
    }
    if j < rest.len() && rest[j] == b'.' {
        j += 1;
        while j < rest.len() && (rest[j].is_ascii_digit() || rest[j] == b'-') {
            j += 1;
        }
    }
    rest.get(j) == Some(&b':')
}

/// The index after a quoted string or regex opening at `i` (backslash escapes honoured; an
/// unterminated one runs to the end of its line).
fn skip_quoted(b: &[u8], i: usize) -> usize {
    let q = b[i];
    let mut j = i + 1;
    while j < b.len() && b[j] != q && b[j] != b'\n' {
        j += if b[j] == b'\\' { 2 } else { 1 };
    }
    (j + 1).min(b.len())
}

/// The longest path of rules each naming the next (a name already on the path is recursion and
/// ends it), computed without recursion: a 10,000-rule chain must not overflow this thread.
fn longest_chain(rules: &[(String, Vec<String>)]) -> usize {
    let index: HashMap<&str, usize> =
        rules.iter().enumerate().map(|(i, (n, _))| (n.as_str(), i)).collect();
    let edges: Vec<Vec<usize>> = rules
        .iter()
        .map(|(_, body)| {
            let mut seen = HashSet::new();
            body.iter()
                .filter_map(|n| index.get(n.as_str()).copied())
                .filter(|&t| seen.insert(t))
                .collect()
        })
        .collect();
    // Post-order DFS; a node on the stack reached again is a back edge (recursion), skipped.
    let mut longest = vec![0usize; rules.len()];
    let mut state = vec![0u8; rules.len()]; // 0 new, 1 on the stack, 2 done
    for root in 0..rules.len() {
        if state[root] != 0 {
            continue;
        }
        let mut stack = vec![(root, 0usize)];
        state[root] = 1;
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            if let Some(&t) = edges[node].get(*next) {
                *next += 1;
                if state[t] == 0 {
                    state[t] = 1;
                    stack.push((t, 0));
                }
            } else {
                let below = edges[node].iter().filter(|&&t| state[t] == 2).map(|&t| longest[t]);
                longest[node] = 1 + below.max().unwrap_or(0);
                state[node] = 2;
                stack.pop();
            }
        }
    }
    longest.into_iter().max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lim() -> FormatLimits {
        FormatLimits::default()
    }

    fn chain_grammar(n: usize) -> String {
        let mut g = String::from("start: r0\n");
        for i in 0..n {
            g.push_str(&format!("r{i}: r{}\n", i + 1));
        }
        g.push_str(&format!("r{n}: \"end\"\n"));
        g
    }

    #[test]
    fn a_long_rule_chain_is_refused_and_a_short_one_is_not() {
        let e = check_lark(&chain_grammar(700), &lim()).unwrap_err();
        assert!(e.contains("chain of rules") && e.contains("702") && e.contains("64"), "{e}");
        check_lark(&chain_grammar(40), &lim()).unwrap();
        // 10,000 rules: refused by count, and the chain walk itself does not recurse.
        let big = chain_grammar(10_000);
        assert_eq!(longest_chain(&scan_lark(&big).unwrap().rules), 10_002);
    }

    #[test]
    fn recursion_is_not_a_chain() {
        let g = "start: expr\nexpr: term (\"+\" term)*\nterm: NUMBER | \"(\" expr \")\"\nNUMBER: /[0-9]+/\n";
        let s = scan_lark(g).unwrap();
        assert_eq!(s.rules.len(), 4);
        assert_eq!(longest_chain(&s.rules), 4);
        check_lark(g, &lim()).unwrap();
    }

    #[test]
    fn alternatives_nesting_and_size_are_bounded() {
        let alts = (0..5000).map(|i| format!("\"w{i}\"")).collect::<Vec<_>>().join(" | ");
        let e = check_lark(&format!("start: {alts}\n"), &lim()).unwrap_err();
        assert!(e.contains("alternatives") && e.contains("4999"), "{e}");
        let deep = format!("start: {}\"x\"{}\n", "(".repeat(100), ")".repeat(100));
        assert!(check_lark(&deep, &lim()).unwrap_err().contains("bracket nesting"));
        let long = format!("start: \"{}\"\n", "a".repeat(300_000));
        assert!(check_lark(&long, &lim()).unwrap_err().contains("length in bytes"));
        // `|` inside strings and regexes is not an alternative.
        let s = scan_lark("start: \"a|b\" /c|d/ | \"e\"\n").unwrap();
        assert_eq!(s.alternatives, 1);
    }

    /// 300 objects each defined as holding the next (`$ref` chain), as the probe sent.
    fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(
                format!("d{i}"),
                json!({"type": "object", "properties": {"x": {"$ref": format!("#/$defs/d{}", i + 1)}}}),
            );
        }
        defs.insert(format!("d{n}"), json!({"type": "string"}));
        json!({"$ref": "#/$defs/d0", "$defs": defs})
    }

    #[test]
    fn a_ref_chain_is_refused_by_depth_and_recursion_is_allowed() {
        let e = check_schema(&ref_chain(300), &lim()).unwrap_err();
        assert!(e.contains("nesting") && e.contains("64"), "{e}");
        check_schema(&ref_chain(10), &lim()).unwrap();
        let tree = json!({"$defs": {"node": {"type": "object", "properties": {
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"});
        check_schema(&tree, &lim()).unwrap();
        let e = check_schema(&json!({"enum": (0..3000).collect::<Vec<_>>()}), &lim()).unwrap_err();
        assert!(e.contains("alternatives") && e.contains("3000"), "{e}");
    }

    #[test]
    fn schemas_inside_lark_are_checked() {
        let g = format!("start: obj\nobj: %json {}\n", ref_chain(300));
        let e = check_lark(&g, &lim()).unwrap_err();
        assert!(e.starts_with("a %json in the grammar") && e.contains("nesting"), "{e}");
        let ok = format!("start: obj\nobj: %json {}\n", ref_chain(3));
        check_lark(&ok, &lim()).unwrap();
    }

    #[test]
    fn regexes_are_bounded() {
        check_regex("[a-z]+@[a-z]+\\.com", &lim()).unwrap();
        let deep = format!("{}a{}", "(".repeat(200), ")".repeat(200));
        assert!(check_regex(&deep, &lim()).unwrap_err().contains("nesting limit 64"));
        check_format(&Format::Regex(deep), &lim()).unwrap_err();
    }
}
