//! How requests enter: validated and tokenized (the prompt bounded before it is tokenized, a chat
//! rendered within that bound), then queued for the scheduler as one job (bounded: a full queue is
//! RESOURCE_EXHAUSTED), journaled when the coordinator keeps a journal, and found again by their
//! idempotency key.

use crate::formats::FormatError;
use crate::jobs::JobRecord;
use crate::journal::Unfinished;
use crate::scheduler::SeqRequest;
use crate::service::CoordinatorService;
use layerstream_model::{tokenizer::RenderBudget, Message};
use layerstream_rpc::v1::*;
use layerstream_serving::grammar::{answer_rule, Constraint, Format, Grammars};
use layerstream_serving::spec::SpecLimits;
use layerstream_serving::tools::{self, ToolFormat};
use layerstream_serving::{
    check_chat, check_request, Field, GenerateParams, RequestError, SamplingParams,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, watch};
use tracing::{info, info_span};

/// A job id no other client can guess (128 random bits from the kernel), so nobody watches or
/// cancels a job they were not given.
pub fn random_job_id() -> String {
    format!("job-{}", layerstream_rpc::auth::random_hex())
}

/// Bytes of prompt text allowed per token of context before tokenizing: a BPE token rarely spans more
/// than a few dozen bytes, so anything longer cannot fit.
pub const PROMPT_BYTES_PER_TOKEN: usize = 64;

/// The most prompt bytes a request may carry for a model with `context` positions.
pub fn prompt_byte_limit(context: usize) -> usize {
    context.saturating_mul(PROMPT_BYTES_PER_TOKEN)
}

/// Default `max_new_tokens` when a request leaves it 0.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

impl CoordinatorService {
    /// The request's prompt as token ids (chat rendered through the template), bounded first.
    pub(crate) fn input_ids(&self, r: &GenerateRequest) -> Result<Vec<u32>, RequestError> {
        // Bounded before tokenizing: a multi-megabyte prompt cannot fit the context anyway, and
        // tokenizing it would cost seconds of CPU and hundreds of MB.
        let bytes = match &r.input {
            Some(generate_request::Input::Prompt(p)) => p.len(),
            Some(generate_request::Input::Chat(c)) => {
                c.messages.iter().map(|m| m.content.len() + m.role.len()).sum()
            }
            _ => 0,
        };
        let most = prompt_byte_limit(self.context);
        if bytes > most {
            return Err(RequestError::new(Field::Prompt, format!(
                "{bytes} bytes exceed the {most}-byte bound ({PROMPT_BYTES_PER_TOKEN} bytes a token of the model's {}-token context)",
                self.context
            )));
        }
        let bad =
            |field| move |e: layerstream_model::Error| RequestError::new(field, e.to_string());
        match &r.input {
            Some(generate_request::Input::Prompt(p)) => {
                self.tokenizer.encode(p).map_err(bad(Field::Prompt))
            }
            Some(generate_request::Input::TokenIds(t)) => Ok(t.ids.clone()),
            Some(generate_request::Input::Chat(c)) => {
                check_chat(c.messages.iter().map(|m| m.role.as_str()))?;
                let msgs = c
                    .messages
                    .iter()
                    .enumerate()
                    .map(|(i, m)| chat_message(i, m))
                    .collect::<Result<Vec<Message>, RequestError>>()?;
                let funcs = request_functions(r)?;
                let format = self.tool_format();
                let (msgs, tools) = tools::prepare(format, msgs, &funcs);
                // The rendering is bounded like the prompt: a template cannot amplify a request.
                let budget = RenderBudget::bytes(most);
                let text = self
                    .tokenizer
                    .apply_chat_template_tools(&msgs, tools.as_ref(), budget)
                    .map_err(bad(Field::Chat))?;
                self.tokenizer.encode_chat(&text).map_err(bad(Field::Chat))
            }
            None => {
                Err(RequestError::new(Field::Input, "none given: set prompt, chat or token_ids"))
            }
        }
    }

    fn params(r: &GenerateRequest) -> GenerateParams {
        let s = r.sampling.clone().unwrap_or_default();
        GenerateParams {
            max_new_tokens: if r.max_new_tokens == 0 {
                DEFAULT_MAX_NEW_TOKENS
            } else {
                r.max_new_tokens as usize
            },
            stop: r.stop.clone(),
            ignore_eos: r.ignore_eos,
            sampling: SamplingParams::from_wire(&s),
            speculative: r.speculative.map_or_else(Default::default, |s| SpecLimits {
                n_max: s.max_tokens.map(|n| n as usize),
                n_min: s.min_tokens as usize,
            }),
            prompt_logprobs: r.prompt_logprobs.map(|k| k as usize),
        }
    }

    /// Validates, registers and queues a job; returns (job id, trace id). A job submitted with an
    /// idempotency key the coordinator already holds is that job (nothing new is queued). A refusal
    /// is counted in the metrics by its code. Output formats compile first, on the format pool
    /// (never on the runtime's threads).
    pub(crate) async fn submit(
        &self,
        requests: &[GenerateRequest],
        key: Option<&str>,
        tenant: Option<usize>,
    ) -> crate::Result<(String, String)> {
        if let Some(found) = key.and_then(|k| self.jobs.by_key(k)) {
            info!(job_id = %found.0, "idempotency key of a job already held: the same job");
            return Ok(found);
        }
        let extras = match self.compile_all(requests).await {
            Ok(x) => x,
            Err(e) => {
                self.metrics.rejected(e.reject_reason());
                return Err(e);
            }
        };
        let _one_at_a_time = key.map(|_| layerstream_model::sync::lock(&self.keyed));
        if let Some(found) = key.and_then(|k| self.jobs.by_key(k)) {
            return Ok(found);
        }
        let entry = Entry { requests, key, resumed: None, tenant };
        self.submit_checked(entry, extras).inspect_err(|e| self.metrics.rejected(e.reject_reason()))
    }

    /// Queues again, under their ids, the jobs a journal held when the coordinator stopped; each
    /// request continues from the tokens the journal holds (its prompt and those tokens are
    /// prefilled, their events shown again as they were, then it goes on): a reconnecting client
    /// is never given a second answer stitched to the first.
    pub(crate) async fn resume(&self, jobs: Vec<Unfinished>) {
        for u in jobs {
            // (The API key a job came with is not journaled: a resumed job's prefix blocks are
            // scoped by its cache_salt alone, under no key, which no live keyed request shares.)
            let entry = Entry {
                requests: &u.requests,
                key: u.key.as_deref(),
                resumed: Some(&u),
                tenant: None,
            };
            let queued = match self.compile_all(&u.requests).await {
                Ok(extras) => self.submit_checked(entry, extras),
                Err(e) => Err(e),
            };
            match queued {
                Ok((id, _)) => tracing::warn!(job_id = %id, "job resumed from the journal"),
                Err(e) => {
                    tracing::error!(job_id = %u.job_id, error = %e, "a journaled job could not be resumed; dropped");
                    if let Some(j) = &self.journal {
                        j.finish(&u.job_id);
                    }
                }
            }
        }
    }

    /// Each request's output constraint compiled (on the format pool) and its tool-call format.
    async fn compile_all(&self, requests: &[GenerateRequest]) -> crate::Result<Vec<Extras>> {
        let mut out = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            let (format, tools) = self.format_of(r).map_err(|e| e.in_request(i))?;
            let constraint = match format {
                None => None,
                Some((f, field)) => {
                    let g = self.grammars().map_err(|e| e.in_request(i))?;
                    match self.formats.compile(&g, &f).await {
                        Ok(c) => Some(Box::new(c)),
                        Err(FormatError::Invalid(m)) => {
                            return Err(RequestError::new(field, m).in_request(i).into())
                        }
                        Err(FormatError::Busy(m)) => {
                            return Err(crate::Error::Busy(format!("output formats: {m}")))
                        }
                    }
                }
            };
            out.push(Extras { constraint, tools });
        }
        Ok(out)
    }

    /// How this model's template writes tool calls.
    pub(crate) fn tool_format(&self) -> ToolFormat {
        self.tokenizer.chat_template().map_or(ToolFormat::Generic, ToolFormat::of_template)
    }

    /// The grammar compiler, built on first use.
    fn grammars(&self) -> Result<Arc<Grammars>, RequestError> {
        self.grammars
            .get_or_init(|| {
                Grammars::new(self.tokenizer.clone(), &self.eos)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| {
                RequestError::new(Field::Format, format!("not available for this model: {e}"))
            })
    }

    /// The request's output constraint (its `format`, or a required tool call) with the field it
    /// comes from, and the tool-call format its output is parsed in (None: no tools, or
    /// `tool_choice` "none").
    #[allow(clippy::type_complexity)]
    fn format_of(
        &self,
        r: &GenerateRequest,
    ) -> Result<(Option<(Format, Field)>, Option<tools::Reading>), RequestError> {
        let funcs = request_functions(r)?;
        // (Token ids are taken as a chat the caller rendered with the tools, as the HTTP door does.)
        if !funcs.is_empty() && matches!(r.input, Some(generate_request::Input::Prompt(_))) {
            return Err(RequestError::new(Field::Tools, "tools need a chat (or token ids) input"));
        }
        let choice = r.tool_choice.as_str();
        let named = choice.strip_prefix("function:");
        let forced: Vec<&tools::Function> = match (choice, named) {
            ("" | "auto" | "none", _) => Vec::new(),
            ("required", _) => funcs.iter().collect(),
            (_, Some(name)) => match funcs.iter().find(|f| f.name == name) {
                Some(f) => vec![f],
                None => {
                    return Err(RequestError::new(
                        Field::ToolChoice,
                        format!("names the function {name:?}, which is not in tools"),
                    ))
                }
            },
            (other, None) => {
                return Err(RequestError::new(
                    Field::ToolChoice,
                    format!("{other:?}: must be auto, none, required or function:NAME"),
                ))
            }
        };
        if funcs.is_empty() && !choice.is_empty() && choice != "none" && choice != "auto" {
            return Err(RequestError::new(Field::ToolChoice, "requires tools"));
        }
        let tool_format = self.tool_format();
        // A named function is called once; otherwise as many times as `parallel_tool_calls` lets.
        let parallel = r.parallel_tool_calls.unwrap_or(true) && named.is_none();
        let offered = !funcs.is_empty() && choice != "none";
        let format = match (&r.format, forced.is_empty()) {
            // Calls now; the response format is for the text answer after them.
            (_, false) => Some(Format::Lark(tools::call_grammar(tool_format, &forced, parallel))),
            // `auto`: a call, or a text answer in the format.
            (Some(f), true) if offered => {
                let answer = answer_rule(&output_format(f)?)
                    .map_err(|m| RequestError::new(Field::Format, m))?;
                let all: Vec<&tools::Function> = funcs.iter().collect();
                Some(Format::Lark(tools::call_or_answer_grammar(
                    tool_format,
                    &all,
                    parallel,
                    &answer,
                )))
            }
            (Some(f), true) => Some(output_format(f)?),
            (None, true) => None,
        };
        let field = if forced.is_empty() { Field::Format } else { Field::Tools };
        let names = funcs.iter().map(|f| f.name.clone()).collect();
        let parse =
            offered.then_some(tools::Reading { format: tool_format, one: !parallel, names });
        Ok((format.map(|f| (f, field)), parse))
    }

    /// One request checked against the model: its token ids, parameters and what goes with them.
    fn prepare(
        &self,
        r: &GenerateRequest,
        extras: Extras,
    ) -> Result<(Vec<u32>, GenerateParams, Extras), RequestError> {
        let ids = self.input_ids(r)?;
        let mut p = Self::params(r);
        check_request(&ids, &p, self.vocab, self.context)?;
        if ids.len() + p.max_new_tokens > self.kv_capacity {
            return Err(RequestError::new(
                Field::MaxNewTokens,
                format!(
                    "{} prompt + {} new tokens exceed the KV capacity of {} positions",
                    ids.len(),
                    p.max_new_tokens,
                    self.kv_capacity
                ),
            ));
        }
        // At most one call and no grammar to end it (`auto`): the first call's closing tag ends
        // the output (a grammar ends the others).
        let tagged = |f| matches!(f, ToolFormat::Hermes | ToolFormat::Generic);
        if extras.constraint.is_none()
            && extras.tools.as_ref().is_some_and(|t| t.one && tagged(t.format))
        {
            p.stop.push("</tool_call>".into());
        }
        // What the head worker needs to apply OpenAI's penalties and min_tokens.
        p.sampling.prompt_len = ids.len();
        p.sampling.eos_ids = self.eos.clone();
        if extras.constraint.is_some() || p.prompt_logprobs.is_some() {
            // Drafts are not masked, and prompt scores need a plain prefill: no speculation.
            p.speculative.n_max = Some(0);
        }
        Ok((ids, p, extras))
    }

    /// Journals a new job (durably) before the client learns its id: a crash from then on resumes
    /// it. A journal that cannot be written (a full disk, say) refuses the jobs that asked to be
    /// found again (an idempotency key); others run without surviving a restart.
    fn journal_job(&self, entry: &Entry<'_>, job_id: &str, trace_id: &str) -> crate::Result<()> {
        let (Some(j), None) = (&self.journal, entry.resumed) else { return Ok(()) };
        if let Err(e) = j.record_job(job_id, trace_id, entry.key, entry.requests) {
            if entry.key.is_some() {
                return Err(crate::Error::Unavailable(format!(
                    "{e}; a job with an idempotency key must be journaled: retry later"
                )));
            }
            tracing::warn!(%job_id, error = %e, "job not journaled: it will not survive a restart");
        }
        Ok(())
    }

    /// The job's record (what `Status` and `Cancel` find), with one cancel flag per request.
    fn record_job(
        &self,
        entry: &Entry<'_>,
        job_id: &str,
        trace_id: &str,
        requests: usize,
    ) -> Vec<Arc<AtomicBool>> {
        let cancels: Vec<Arc<AtomicBool>> =
            (0..requests).map(|_| Arc::new(AtomicBool::new(false))).collect();
        let (live, _) = watch::channel(0usize);
        let record = JobRecord {
            trace_id: trace_id.to_owned(),
            requests,
            history: Vec::new(),
            cancel: cancels.clone(),
            live,
            cancelled: false,
            finished_at: None,
            key: entry.key.map(str::to_owned),
        };
        self.jobs.insert(job_id.to_owned(), record);
        cancels
    }

    fn submit_checked(
        &self,
        entry: Entry<'_>,
        extras: Vec<Extras>,
    ) -> crate::Result<(String, String)> {
        let requests = entry.requests;
        if requests.is_empty() {
            return Err(RequestError::new(Field::Requests, "a job needs at least one").into());
        }
        let mut prepared = Vec::with_capacity(requests.len());
        for (i, (r, x)) in requests.iter().zip(extras).enumerate() {
            prepared.push(self.prepare(r, x).map_err(|e| e.in_request(i))?);
        }
        let n = prepared.len();
        let before = self.waiting.fetch_add(n, Ordering::SeqCst);
        if before + n > self.queue_size {
            self.waiting.fetch_sub(n, Ordering::SeqCst);
            return Err(crate::Error::Busy(format!(
                "the queue holds {before} waiting sequences and takes at most {} (--queue-size); retry later",
                self.queue_size
            )));
        }
        let job_id = entry.resumed.map_or_else(random_job_id, |u| u.job_id.clone());
        // Under the API call's span (gRPC handler or HTTP request): one request, one trace.
        let span = info_span!(parent: tracing::Span::current(), "job", job_id = %job_id, requests = requests.len() as i64);
        let trace_id = match entry.resumed {
            Some(u) => u.trace_id.clone(),
            None => layerstream_telemetry::trace_id(&span),
        };
        if let Err(e) = self.journal_job(&entry, &job_id, &trace_id) {
            self.waiting.fetch_sub(n, Ordering::SeqCst);
            return Err(e);
        }
        let cancels = self.record_job(&entry, &job_id, &trace_id, n);
        for (i, ((ids, p, extras), cancel)) in prepared.into_iter().zip(cancels).enumerate() {
            let (tx, mut rx) = mpsc::channel(256);
            let seq = SeqRequest {
                seq_id: self.next_seq.fetch_add(1, Ordering::Relaxed),
                index: i as u32,
                input_ids: ids,
                params: p,
                events: tx,
                span: span.clone(),
                trace_id: trace_id.clone(),
                cancel,
                queued: std::time::Instant::now(),
                constraint: extras.constraint,
                tools: extras.tools,
                salt: crate::flags::cache_salt(
                    self.cache_scope,
                    entry.tenant,
                    &requests[i].cache_salt,
                ),
                journaled: journaled(entry.resumed, i),
            };
            if self.queue.try_send(seq).is_err() {
                // The ones already sent are cancelled and leave the count in the scheduler.
                self.waiting.fetch_sub(n - i, Ordering::SeqCst);
                self.jobs.cancel(&job_id);
                // Refused: nothing of it may come back after a restart.
                if let Some(j) = &self.journal {
                    j.finish(&job_id);
                }
                return Err(crate::Error::Busy("the job queue is full; retry later".into()));
            }
            let recorder = Recorder {
                jobs: self.jobs.clone(),
                journal: self.journal.clone(),
                job: job_id.clone(),
                index: i as u32,
                replayed: journaled(entry.resumed, i).len(),
            };
            tokio::spawn(async move {
                let mut recorder = recorder;
                while let Some(ev) = rx.recv().await {
                    recorder.record(ev).await;
                }
            });
        }
        info!(%job_id, %trace_id, "job queued");
        Ok((job_id, trace_id))
    }
}

/// What a prepared request carries besides its ids and parameters.
struct Extras {
    constraint: Option<Box<Constraint>>,
    tools: Option<tools::Reading>,
}

/// A wire chat message as the template sees it: an assistant's tool calls with their arguments
/// as JSON objects (OpenAI sends them as text), a tool result's call id and name.
fn chat_message(i: usize, m: &ChatMessage) -> Result<Message, RequestError> {
    let mut msg = Message::new(&m.role, &m.content);
    if !m.tool_calls_json.is_empty() {
        let bad =
            |why: &str| RequestError::new(Field::Chat, format!("message {i}: tool_calls {why}"));
        let mut calls: serde_json::Value = serde_json::from_str(&m.tool_calls_json)
            .map_err(|e| bad(&format!("is not JSON: {e}")))?;
        for c in calls.as_array_mut().ok_or_else(|| bad("must be a list"))? {
            let f = c.get_mut("function").ok_or_else(|| bad("need a function"))?;
            if let Some(serde_json::Value::String(args)) = f.get("arguments") {
                let parsed = serde_json::from_str(args)
                    .map_err(|e| bad(&format!("arguments are not JSON: {e}")))?;
                f["arguments"] = parsed;
            }
        }
        msg.tool_calls = Some(calls);
    }
    msg.tool_call_id = (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone());
    msg.name = (!m.name.is_empty()).then(|| m.name.clone());
    Ok(msg)
}

/// The request's `tools`, checked.
fn request_functions(r: &GenerateRequest) -> Result<Vec<tools::Function>, RequestError> {
    let list = r
        .tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let params = if t.parameters_json.is_empty() {
                None
            } else {
                Some(serde_json::from_str(&t.parameters_json).map_err(|e| {
                    RequestError::new(Field::Tools, format!("tools[{i}].parameters: {e}"))
                })?)
            };
            Ok((t.name.clone(), t.description.clone(), params))
        })
        .collect::<Result<Vec<_>, RequestError>>()?;
    tools::functions(list).map_err(|e| RequestError::new(Field::Tools, e))
}

/// The wire's output format as the grammar compiler takes it.
fn output_format(f: &OutputFormat) -> Result<Format, RequestError> {
    let bad = |m: String| RequestError::new(Field::Format, m);
    Ok(match &f.kind {
        Some(output_format::Kind::JsonObject(_)) => Format::JsonObject,
        Some(output_format::Kind::JsonSchema(s)) => Format::JsonSchema(
            serde_json::from_str(s).map_err(|e| bad(format!("the schema is not JSON: {e}")))?,
        ),
        Some(output_format::Kind::Regex(r)) => Format::Regex(r.clone()),
        Some(output_format::Kind::Lark(g)) => Format::Lark(g.clone()),
        None => return Err(bad("names no format".into())),
    })
}

/// A job as it enters.
struct Entry<'a> {
    requests: &'a [GenerateRequest],
    key: Option<&'a str>,
    /// Set when the job comes back from the journal (same id, trace id and key).
    resumed: Option<&'a Unfinished>,
    /// The API key the job came with (its tenant, for the prefix cache's scope).
    tenant: Option<usize>,
}

/// The events request `i` of a resumed job had produced (empty for a new job).
fn journaled(resumed: Option<&Unfinished>, i: usize) -> Vec<Vec<u32>> {
    resumed.and_then(|u| u.tokens.get(i).cloned()).unwrap_or_default()
}

/// Longest a token event waits for the journal before it is shown anyway (a slow disk never holds
/// a stream back for long; a failing one not at all).
const ACK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Records one request's events: into the journal first (its tokens, and the job's end), then
/// into the job for watchers — so a client never sees a token that a restart would not resume
/// from. A resumed request's first events are the journal's own, replayed: not written again.
struct Recorder {
    jobs: crate::jobs::Jobs,
    journal: Option<Arc<crate::journal::Journal>>,
    job: String,
    index: u32,
    /// Token events still to come back from the journal (a resumed request's replay).
    replayed: usize,
}

impl Recorder {
    async fn record(&mut self, ev: GenerateEvent) {
        if let (Some(j), Some(generate_event::Event::Token(t))) = (&self.journal, &ev.event) {
            if self.replayed > 0 {
                self.replayed -= 1;
            } else {
                let _ =
                    tokio::time::timeout(ACK_WAIT, j.tokens(&self.job, self.index, &t.ids)).await;
            }
        }
        let finished = self.jobs.record(&self.job, ev);
        if let (Some(j), true) = (&self.journal, finished) {
            j.finish(&self.job);
        }
    }
}
