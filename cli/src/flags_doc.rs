//! The flag reference (`docs/flags.md`), generated from the commands' own clap definitions so it
//! cannot drift from `--help`: `layerstream flags-doc > docs/flags.md`; a test fails when the
//! committed file differs from what the definitions give.

use clap::Command;
use std::fmt::Write;

/// Markdown for every subcommand of `root`: its summary and a table of its arguments.
pub fn markdown(root: &Command) -> String {
    let mut out = String::from(
        "# Flag reference\n\nGenerated from the commands' definitions by `layerstream flags-doc > docs/flags.md` \
         (a test fails when they differ). Every flag also reads the environment variable shown; \
         `layerstream <command> --help` says the same.\n",
    );
    for sub in root.get_subcommands().filter(|s| !s.is_hide_set()) {
        let _ = write!(out, "\n## `{} {}`\n\n", root.get_name(), sub.get_name());
        if let Some(about) = sub.get_about() {
            let _ = writeln!(out, "{}\n", one_line(&about.to_string()));
        }
        let args: Vec<_> = sub
            .get_arguments()
            .filter(|a| !matches!(a.get_id().as_str(), "help" | "version") && !a.is_hide_set())
            .collect();
        if args.is_empty() {
            out.push_str("No flags.\n");
            continue;
        }
        out.push_str("| argument | environment | default | what |\n|---|---|---|---|\n");
        for a in args {
            let name = match a.get_long() {
                Some(l) if a.get_action().takes_values() => {
                    format!("`--{l} <{}>`", a.get_id().as_str().to_uppercase())
                }
                Some(l) => format!("`--{l}`"),
                None => format!("`<{}>`", a.get_id().as_str().to_uppercase()),
            };
            let env = a.get_env().map_or(String::new(), |e| format!("`{}`", e.to_string_lossy()));
            let default: Vec<String> =
                a.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
            let default =
                if default.is_empty() { String::new() } else { format!("`{}`", default.join(",")) };
            let help = a.get_long_help().or(a.get_help()).map_or(String::new(), |h| h.to_string());
            let _ = writeln!(out, "| {name} | {env} | {default} | {} |", one_line(&help));
        }
    }
    out
}

/// A help text on one table line (`|` escaped).
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|")
}
