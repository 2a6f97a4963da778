//! `/metrics`' format, negotiated from `Accept` as Prometheus client libraries do: OpenMetrics when
//! the scraper asks for it (Prometheus does), else the classic text format 0.0.4, which every other
//! scraper and parser reads. The registry writes OpenMetrics; the classic text is derived from it.

/// The classic text format's content type.
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether `accept` (an `Accept` header) asks for OpenMetrics.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| {
        a.split(',').any(|part| {
            let mut fields = part.split(';').map(str::trim);
            let media = fields.next().unwrap_or_default();
            // `q=0` refuses the type.
            let refused = fields.any(|f| f.replace(' ', "") == "q=0");
            media.eq_ignore_ascii_case("application/openmetrics-text") && !refused
        })
    })
}

/// OpenMetrics text as the classic format: a counter's HELP and TYPE lines name its `_total`
/// samples, an info family becomes a gauge of its `_info` samples, `# UNIT` and `# EOF` lines and
/// exemplars go.
pub fn classic(openmetrics: &str) -> String {
    let kinds: std::collections::HashMap<&str, &str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' ')).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find(|p| line.starts_with(p));
        match meta {
            Some(prefix) => {
                let rest = &line[prefix.len()..];
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let (suffix, tail) = match (kinds.get(name).copied(), prefix) {
                    (Some("counter"), _) => ("_total", tail),
                    (Some("info"), "# TYPE ") => ("_info", "gauge"),
                    (Some("info"), _) => ("_info", tail),
                    _ => ("", tail),
                };
                out.push_str(format!("{prefix}{name}{suffix} {tail}").trim_end());
            }
            // A sample, without its exemplar (` # {…} value`).
            None => out.push_str(line.split(" # ").next().unwrap_or(line)),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_headers_choose_the_format() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(!wants_openmetrics(Some("text/plain; version=0.0.4")));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("application/openmetrics-text; q=0, text/plain")));
    }

    #[test]
    fn counters_name_their_samples_in_the_classic_text() {
        let om = "# HELP ls_tokens Tokens generated.\n# TYPE ls_tokens counter\nls_tokens_total 7 # {trace_id=\"a\"} 1\n# HELP ls_build Build.\n# TYPE ls_build info\nls_build_info{version=\"1\"} 1\n# HELP ls_seconds Step time.\n# TYPE ls_seconds histogram\n# UNIT ls_seconds seconds\nls_seconds_bucket{le=\"1.0\"} 2\nls_seconds_sum 0.5\nls_seconds_count 2\n# EOF\n";
        let want = "# HELP ls_tokens_total Tokens generated.\n# TYPE ls_tokens_total counter\nls_tokens_total 7\n# HELP ls_build_info Build.\n# TYPE ls_build_info gauge\nls_build_info{version=\"1\"} 1\n# HELP ls_seconds Step time.\n# TYPE ls_seconds histogram\nls_seconds_bucket{le=\"1.0\"} 2\nls_seconds_sum 0.5\nls_seconds_count 2\n";
        assert_eq!(classic(om), want);
    }
}
