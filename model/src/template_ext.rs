//! What transformers' chat-template environment adds to Jinja, for the templates that use it:
//! `strftime_now(format)` (Llama 3.x, Mistral Small, Granite, Apertus put today's date in the system
//! prompt) and the `{% generation %}…{% endgeneration %}` block (LFM2.5, Laguna mark the assistant's
//! tokens with it; transformers renders its body unchanged).

/// `src` with every `{% generation %}` / `{% endgeneration %}` tag turned into `{% if true %}` /
/// `{% endif %}`, whitespace-control dashes kept, so the body renders as it is.
pub fn generation_blocks(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else { break };
        let tag = &rest[start..start + len + 2];
        let inner = &tag[2..tag.len() - 2];
        let (lead, trail) = (inner.starts_with('-'), inner.ends_with('-'));
        let word = inner.trim_matches('-').trim();
        out.push_str(&rest[..start]);
        let keyword = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match keyword {
            Some(k) => {
                let d = |on: bool| if on { "-" } else { "" };
                out.push_str(&format!("{{%{} {k} {}%}}", d(lead), d(trail)));
            }
            None => out.push_str(tag),
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// (year, month 1–12, day 1–31) of a count of days since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] =
    ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Python's `strftime` of the UTC time `unix` seconds for the codes chat templates use (%d %m %Y %y
/// %b %B %a %A %H %M %S %j %%); any other code is kept as written.
pub fn strftime(unix: i64, fmt: &str) -> String {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('B') => out.push_str(MONTHS[m as usize - 1]),
            Some('b') => out.push_str(&MONTHS[m as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 of a (year, month, day).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Environment variable fixing "now" for `strftime_now` (Unix seconds), for reproducible renders.
pub const NOW_ENV: &str = "LAYERSTREAM_TEMPLATE_NOW";

/// `strftime` of now (UTC), or of the time `LAYERSTREAM_TEMPLATE_NOW` gives.
pub fn strftime_now(fmt: &str) -> String {
    let now = std::env::var(NOW_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<i64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64)
        });
    strftime(now, fmt)
}

/// JSON as transformers' chat templates write it (`tojson` is Python's `json.dumps(x,
/// ensure_ascii=False, indent=indent)`): `", "` and `": "` between items without an indent, keys
/// in their order, nothing escaped for HTML (minijinja's own `tojson` is compact and escapes `<`).
pub fn py_json(v: &serde_json::Value, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_py_json(&mut out, v, indent, 0);
    out
}

fn write_py_json(out: &mut String, v: &serde_json::Value, indent: Option<usize>, depth: usize) {
    use serde_json::Value;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_py_json(out, x, indent, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                write_py_json(out, x, indent, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).unwrap_or_default()),
    }
}

/// A value as Python's `str()` prints it, for `{{ value }}` of a dict or list in a template
/// (transformers renders with Jinja2, which prints Python's repr: single quotes, True/None).
pub fn py_repr(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => {
            // Python quotes with ' unless the text holds ' and no ".
            let q = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
            let mut out = String::from(q);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == q => {
                        out.push('\\');
                        out.push(c);
                    }
                    c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                        out.push_str(&format!("\\x{:02x}", c as u32))
                    }
                    c => out.push(c),
                }
            }
            out.push(q);
            out
        }
        Value::Array(a) => format!("[{}]", a.iter().map(py_repr).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => format!(
            "{{{}}}",
            o.iter()
                .map(|(k, x)| format!("{}: {}", py_repr(&Value::String(k.clone())), py_repr(x)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// HTML-escapes `s` as Python's markupsafe does (Jinja2's `escape` filter).
pub fn markupsafe_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&#34;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_format_as_python_formats_them() {
        // date -u -d @0 / @1764028800 / @951782400 (a leap day).
        assert_eq!(strftime(0, "%Y-%m-%d %H:%M:%S %a"), "1970-01-01 00:00:00 Thu");
        assert_eq!(strftime(1_764_028_800, "%d %b %Y"), "25 Nov 2025");
        assert_eq!(
            strftime(1_764_028_800, "%A %d %B %y, day %j"),
            "Tuesday 25 November 25, day 329"
        );
        assert_eq!(strftime(951_782_400, "%d %B %Y %j %%"), "29 February 2000 060 %");
        for days in [-1000i64, 0, 11_016, 20_417, 30_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn generation_blocks_render_their_body() {
        let t = "a{% generation %}b{%- endgeneration -%} c{%if x%}d{% endif %}";
        assert_eq!(generation_blocks(t), "a{% if true %}b{%- endif -%} c{%if x%}d{% endif %}");
    }
}
