//! `layerstream submit`: one request to a running coordinator over gRPC, tokens streamed as they
//! arrive, then the job's stats and trace id.

use crate::prompt::{PromptArgs, SamplingArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use layerstream_rpc::auth::Bearer;
use layerstream_rpc::v1::coordinator_client::CoordinatorClient;
use layerstream_rpc::v1::{
    generate_event, generate_request, ChatMessage, ChatMessages, GenerateRequest, OutputFormat,
    TokenIds,
};
use std::io::Write;

/// Flags of `layerstream submit`.
#[derive(Args, Debug)]
pub struct SubmitArgs {
    /// Coordinator address.
    #[arg(long, env = "LAYERSTREAM_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    #[command(flatten)]
    pub prompt: PromptArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Print one JSON object (input_ids, output_ids, text, stats, trace_id) as the last line.
    #[arg(long, env = "LAYERSTREAM_JSON")]
    pub json: bool,
    /// The coordinator's API key (sent as `authorization: Bearer <key>`).
    #[arg(long, env = "LAYERSTREAM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Read the API key from this file (its first line) instead: a key on the command line is
    /// readable by every local user in `/proc/<pid>/cmdline`.
    #[arg(long, env = "LAYERSTREAM_API_KEY_FILE")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// PEM CA certificate to trust for an `https://` coordinator.
    #[arg(long, env = "LAYERSTREAM_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Constrain the output to JSON valid under this JSON schema (a file, or the schema itself).
    #[arg(long, env = "LAYERSTREAM_JSON_SCHEMA", group = "format")]
    pub json_schema: Option<String>,
    /// Constrain the output to any JSON object.
    #[arg(long, env = "LAYERSTREAM_JSON_OBJECT", group = "format")]
    pub json_object: bool,
    /// Constrain the output to text matching this regular expression, whole.
    #[arg(long, env = "LAYERSTREAM_REGEX", group = "format")]
    pub regex: Option<String>,
    /// Constrain the output to this Lark grammar (a file; llguidance's dialect).
    #[arg(long, env = "LAYERSTREAM_GRAMMAR", group = "format")]
    pub grammar: Option<std::path::PathBuf>,
}

/// The key to send: `--api-key-file`'s first, else `--api-key` / `LAYERSTREAM_API_KEY`.
fn api_key(a: &SubmitArgs) -> Result<Option<String>> {
    let argv: Vec<String> = std::env::args().collect();
    let keys =
        layerstream_rpc::auth::api_keys(a.api_key.as_deref(), a.api_key_file.as_deref(), &argv)
            .map_err(anyhow::Error::msg)?;
    Ok(keys.into_iter().next())
}

/// The output format the flags ask for (None: free text).
fn format(a: &SubmitArgs) -> Result<Option<OutputFormat>> {
    use layerstream_rpc::v1::output_format::Kind;
    let kind = if let Some(s) = &a.json_schema {
        // A path to a schema file, or the schema's text.
        let text = if std::path::Path::new(s).is_file() {
            std::fs::read_to_string(s).with_context(|| format!("reading {s}"))?
        } else {
            s.clone()
        };
        Some(Kind::JsonSchema(text))
    } else if a.json_object {
        Some(Kind::JsonObject(true))
    } else if let Some(r) = &a.regex {
        Some(Kind::Regex(r.clone()))
    } else if let Some(g) = &a.grammar {
        let text =
            std::fs::read_to_string(g).with_context(|| format!("reading {}", g.display()))?;
        Some(Kind::Lark(text))
    } else {
        None
    };
    Ok(kind.map(|k| OutputFormat { kind: Some(k) }))
}

fn request(a: &SubmitArgs) -> Result<GenerateRequest> {
    use generate_request::Input;
    let p = &a.prompt;
    let input = if let Some(t) = &p.prompt {
        Input::Prompt(t.clone())
    } else if let Some(c) = &p.chat {
        Input::Chat(ChatMessages {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: c.clone(),
                ..Default::default()
            }],
        })
    } else if let Some(path) = &p.messages {
        let v: Vec<layerstream_model::Message> = serde_json::from_str(
            &std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| {
            format!("{}: expected a JSON list of {{\"role\", \"content\"}}", path.display())
        })?;
        Input::Chat(ChatMessages {
            messages: v
                .into_iter()
                .map(|m| ChatMessage { role: m.role, content: m.content, ..Default::default() })
                .collect(),
        })
    } else if let Some(ids) = &p.token_ids {
        Input::TokenIds(TokenIds { ids: ids.clone() })
    } else {
        bail!("give one of --prompt, --chat, --messages, --token-ids");
    };
    let s = &a.sampling;
    Ok(GenerateRequest {
        input: Some(input),
        max_new_tokens: s.max_new_tokens as u32,
        sampling: Some(s.params().sampling.to_wire()),
        stop: s.stop.clone(),
        ignore_eos: s.ignore_eos,
        speculative: (s.draft_max.is_some() || s.draft_min > 0).then_some(
            layerstream_rpc::v1::Speculative { max_tokens: s.draft_max, min_tokens: s.draft_min },
        ),
        format: format(a)?,
        ..Default::default()
    })
}

/// A connection failure said the way a user can act on: no coordinator there, and how to start one.
pub(crate) fn no_server(addr: &str, e: &tonic::transport::Error) -> anyhow::Error {
    let mut cause = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        cause = s.to_string();
        src = s.source();
    }
    anyhow::anyhow!("no coordinator answers at {addr} ({cause}): start one with `layerstream up`, or point --addr (LAYERSTREAM_ADDR) at a running one")
}

/// Runs the command.
pub async fn run(a: SubmitArgs) -> Result<()> {
    let req = request(&a)?;
    let bearer =
        Bearer::new(api_key(&a)?.as_deref()).map_err(|m| anyhow::anyhow!("--api-key: {m}"))?;
    let tls = layerstream_rpc::transport::client_tls(a.tls_ca.as_deref())
        .map_err(|m| anyhow::anyhow!("--tls-ca: {m}"))?;
    let channel = layerstream_rpc::transport::endpoint(&a.addr, tls.as_ref())?
        .connect()
        .await
        .map_err(|e| no_server(&a.addr, &e))?;
    let mut client = CoordinatorClient::new(bearer.wrap(channel));
    let mut stream = client
        .generate(req)
        .await
        .map_err(|s| anyhow::anyhow!("{}: {}", a.addr, s.message()))?
        .into_inner();
    let mut out = std::io::stdout().lock();
    loop {
        let ev = match stream.message().await {
            Ok(Some(ev)) => ev,
            Ok(None) => bail!("the coordinator ended the stream before the job finished"),
            Err(s) => bail!("job failed: {}", s.message()),
        };
        match ev.event {
            Some(generate_event::Event::Token(t)) if !a.json => {
                out.write_all(t.text.as_bytes())?;
                out.flush()?;
            }
            Some(generate_event::Event::Done(d)) => {
                let st = d.stats.unwrap_or_default();
                let reason = layerstream_serving::stop::reason_name(d.finish_reason());
                if d.finish_reason() == layerstream_serving::FinishReason::Error {
                    bail!("job failed: {}", d.error);
                }
                if a.json {
                    let v = serde_json::json!({
                        "input_ids": d.input_ids, "output_ids": d.output_ids, "text": d.text,
                        "finish_reason": reason, "trace_id": d.trace_id,
                        "stats": {
                            "prompt_tokens": st.prompt_tokens, "completion_tokens": st.completion_tokens,
                            "tokens_per_s": st.tokens_per_s, "bytes_streamed": st.bytes_streamed,
                            "transfer_ms": st.transfer_ms, "compute_ms": st.compute_ms, "stall_ms": st.stall_ms,
                            "overlap_pct": st.overlap_pct, "wall_ms": st.wall_ms, "steps": st.steps, "max_batch": st.max_batch,
                            "layers_ms": st.layers_ms, "ideal_ms": st.ideal_ms,
                            "first_token_ms": st.first_token_ms, "decode_tokens_per_s": st.decode_tokens_per_s,
                            "replays": st.replays, "workers_busy_pct": st.workers_busy_pct,
                            "experts_needed": st.experts_needed, "experts_hit": st.experts_hit,
                            "experts_prefetched": st.experts_prefetched, "experts_missed": st.experts_missed,
                            "spec_drafted": st.spec_drafted, "spec_accepted": st.spec_accepted,
                            "weight_passes": st.weight_passes, "tokens_per_pass": st.tokens_per_pass,
                            "cached_tokens": st.cached_tokens, "preemptions": st.preemptions,
                        },
                    });
                    writeln!(out, "{v}")?;
                } else {
                    writeln!(out)?;
                    eprintln!(
                        "[{} prompt + {} generated tokens, {:.1} tok/s, first token {:.0} ms, decode {:.1} tok/s | streamed {:.1} MB, transfer {:.0} ms, compute {:.0} ms, overlap {:.0}%, workers busy {:.0}% | finish: {}]",
                        st.prompt_tokens, st.completion_tokens, st.tokens_per_s, st.first_token_ms, st.decode_tokens_per_s, st.bytes_streamed as f64 / 1e6, st.transfer_ms, st.compute_ms, st.overlap_pct, st.workers_busy_pct, reason
                    );
                    if st.experts_needed > 0 {
                        eprintln!(
                            "[experts: {} needed, {} on the device, {} prefetched, {} fetched on demand]",
                            st.experts_needed, st.experts_hit, st.experts_prefetched, st.experts_missed
                        );
                    }
                    if st.spec_drafted > 0 {
                        eprintln!(
                            "[speculative: {} drafted, {} accepted, {:.2} tokens per weight pass]",
                            st.spec_drafted, st.spec_accepted, st.tokens_per_pass
                        );
                    }
                    eprintln!("trace id: {}", d.trace_id);
                }
                return Ok(());
            }
            _ => {}
        }
    }
}
