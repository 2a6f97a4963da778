//! `/v1/chat/completions` and `/v1/completions`: a request is translated (`openai`), queued through
//! the same `submit` as gRPC's Generate, and its events answered as one JSON body or as Server-Sent
//! Events in OpenAI's chunk format (ending with `data: [DONE]`). A client that goes away drops the
//! event stream, which cancels the job.

use super::bodies::{
    Choice, Delta, Envelope, Logprobs, Message, PromptLogprob, PromptLogprobs, PromptTokensDetails,
    TokenLogprob, Usage,
};
use super::error::ApiError;
use super::openai::Shape;
use super::{tools, Http};
use axum::http::HeaderValue;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use layerstream_rpc::v1::{
    generate_event, generate_request, FinalEvent, FinishReason, GenerateEvent, GenerateRequest,
    TokenIds, TokenLogprobs,
};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

/// Which endpoint: the names and shapes of its objects differ.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
        }
    }
    fn path(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        }
    }
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
        FinishReason::ToolCalls => "tool_calls",
        _ => "stop",
    }
}

/// One choice's answer as it arrives: its tokens, their log-probabilities, its prompt's.
#[derive(Default)]
struct Collected {
    ids: Vec<u32>,
    lps: Vec<TokenLogprobs>,
    prompt: Vec<TokenLogprobs>,
    done: Option<FinalEvent>,
    /// Streaming: the text offset of its next token (completions' logprobs), its first token seen.
    offset: usize,
    started: bool,
}

/// One request's answer being built: ids, the texts of its tokens, log-probabilities.
struct Answer {
    h: Arc<Http>,
    kind: Kind,
    id: String,
    created: u64,
    shape: Shape,
    /// Each prompt's ids (echo, prompt log-probabilities); choice `i` answers prompt `i / n`.
    prompts: Vec<Vec<u32>>,
    /// `echo` with `max_tokens` 0: the one token generated is not part of the answer.
    echo_only: bool,
}

impl Answer {
    fn token_text(&self, id: u32) -> String {
        self.h.svc.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// The length of a generated token's text as the client receives it (special tokens hidden).
    fn shown_len(&self, id: u32) -> usize {
        self.h.svc.tokenizer.decode(&[id], true).map_or(0, |t| t.len())
    }

    /// Choices in all: `n` per prompt.
    fn total(&self) -> usize {
        self.prompts.len() * self.shape.n
    }

    /// The prompt choice `i` answers.
    fn prompt(&self, i: usize) -> &[u32] {
        &self.prompts[i / self.shape.n.max(1)]
    }

    /// The prompts' tokens, each prompt counted once.
    fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(Vec::len).sum()
    }

    /// The usage of every choice: each prompt counted once.
    fn usage(&self, finals: &[&FinalEvent]) -> Usage {
        let p = self.prompt_tokens() as u64;
        let c: u64 =
            if self.echo_only { 0 } else { finals.iter().map(|f| f.output_ids.len() as u64).sum() };
        let cached: u64 = finals
            .iter()
            .step_by(self.shape.n.max(1))
            .filter_map(|f| f.stats.as_ref())
            .map(|s| s.cached_tokens as u64)
            .sum();
        Usage::counted(p, c, Some(PromptTokensDetails { cached_tokens: cached }))
    }

    /// Log-probabilities of `ids` in the endpoint's format (chat: `content` entries; completions:
    /// the legacy parallel lists), `offset` being the text length before them. With `echo`, the
    /// prompt of choice `i` (`prompt`: its scores, the first token's null) comes first.
    fn logprobs(
        &self,
        i: usize,
        ids: &[u32],
        lps: &[TokenLogprobs],
        prompt: Option<&[TokenLogprobs]>,
        offset: &mut usize,
    ) -> Option<Logprobs> {
        if self.shape.logprobs.is_none() || (lps.is_empty() && prompt.is_none()) {
            return None;
        }
        Some(match self.kind {
            Kind::Chat => {
                let content = ids
                    .iter()
                    .zip(lps)
                    .map(|(&id, lp)| {
                        let top = lp
                            .top_ids
                            .iter()
                            .zip(&lp.top_logprobs)
                            .map(|(&t, &v)| TokenLogprob::new(self.token_text(t), v))
                            .collect();
                        let e = TokenLogprob::new(self.token_text(id), lp.logprob);
                        TokenLogprob { top_logprobs: Some(top), ..e }
                    })
                    .collect();
                Logprobs::Chat { content }
            }
            Kind::Completion => self.completion_logprobs(i, ids, lps, prompt, offset),
        })
    }

    /// The completions endpoint's log-probabilities (`logprobs`).
    fn completion_logprobs(
        &self,
        i: usize,
        ids: &[u32],
        lps: &[TokenLogprobs],
        prompt: Option<&[TokenLogprobs]>,
        offset: &mut usize,
    ) -> Logprobs {
        let top_map = |lp: &TokenLogprobs| -> BTreeMap<String, f64> {
            let pairs = lp.top_ids.iter().zip(&lp.top_logprobs);
            pairs.map(|(&t, &v)| (self.token_text(t), v as f64)).collect()
        };
        let (mut tokens, mut token_logprobs, mut top_logprobs, mut text_offset) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // Offsets count the text as returned: the echoed prompt with its special tokens, the
        // output without.
        let mut add = |id: u32, lp: Option<&TokenLogprobs>, echoed: bool| {
            let t = self.token_text(id);
            text_offset.push(*offset);
            *offset += if echoed { t.len() } else { self.shown_len(id) };
            tokens.push(t);
            token_logprobs.push(lp.map(|l| l.logprob as f64));
            top_logprobs.push(lp.map(top_map));
        };
        if let Some(scores) = prompt {
            for (j, &id) in self.prompt(i).iter().enumerate() {
                add(id, j.checked_sub(1).and_then(|j| scores.get(j)), true);
            }
        }
        for (&id, lp) in ids.iter().zip(lps) {
            add(id, Some(lp), false);
        }
        Logprobs::Completion { tokens, token_logprobs, top_logprobs, text_offset }
    }

    /// vLLM's `prompt_logprobs` of choice `i`'s prompt.
    fn prompt_logprobs(&self, i: usize, scores: &[TokenLogprobs]) -> PromptLogprobs {
        let mut out = vec![None];
        for (&id, sc) in self.prompt(i).iter().skip(1).zip(scores) {
            let mut m = BTreeMap::new();
            let mut put = |t: u32, v: f32| {
                m.entry(t.to_string()).or_insert_with(|| PromptLogprob {
                    logprob: v as f64,
                    decoded_token: self.token_text(t),
                });
            };
            put(id, sc.logprob);
            for (&t, &v) in sc.top_ids.iter().zip(&sc.top_logprobs) {
                put(t, v);
            }
            out.push(Some(m));
        }
        out
    }

    /// The text of choice `i`'s prompt (echo).
    fn prompt_text(&self, i: usize) -> String {
        self.h.svc.tokenizer.decode(self.prompt(i), false).unwrap_or_default()
    }

    fn envelope(&self, chunk: bool, choices: Vec<Choice>) -> Envelope<'_> {
        Envelope {
            id: &self.id,
            object: self.kind.object(chunk),
            created: self.created,
            model: &self.h.model,
            system_fingerprint: None,
            choices,
            usage: None,
        }
    }

    /// A streamed chunk of choice `index`: `delta` (chat; completions: its `content` as `text`),
    /// its log-probabilities; `finish` on the last one. `sent`: each choice's tokens so far (the
    /// usage every chunk carries under `continuous_usage_stats`).
    fn chunk(
        &self,
        index: usize,
        delta: Delta,
        logprobs: Option<Logprobs>,
        finish: Option<&'static str>,
        sent: &[u32],
    ) -> String {
        let choice = match self.kind {
            Kind::Chat => Choice::Delta { index, delta, logprobs, finish_reason: finish },
            Kind::Completion => Choice::Text {
                index,
                text: delta.content.unwrap_or_default(),
                logprobs,
                finish_reason: finish,
                prompt_logprobs: None,
            },
        };
        let mut v = self.envelope(true, vec![choice]);
        if self.shape.continuous_usage {
            let p = self.prompt_tokens() as u64;
            let c: u64 = if self.echo_only { 0 } else { sent.iter().map(|&n| n as u64).sum() };
            v.usage = Some(Some(Usage::counted(p, c, None)));
        } else if self.shape.include_usage {
            v.usage = Some(None);
        }
        json_text(&v)
    }

    /// One finished choice of the whole answer.
    fn choice(&self, i: usize, c: &Collected, f: &FinalEvent) -> Choice {
        let (ids, lps) = if self.echo_only { (&[][..], &[][..]) } else { (&c.ids[..], &c.lps[..]) };
        let echo = (self.shape.echo && self.kind == Kind::Completion).then_some(&c.prompt[..]);
        let logprobs = self.logprobs(i, ids, lps, echo, &mut 0);
        let finish_reason = if self.echo_only { "length" } else { finish_name(f.finish_reason()) };
        let prompt_logprobs =
            self.shape.prompt_logprobs.is_some().then(|| self.prompt_logprobs(i, &c.prompt));
        match self.kind {
            Kind::Chat => {
                let calls = !f.tool_calls.is_empty();
                let message = Message {
                    role: "assistant",
                    content: (!calls || !f.text.is_empty()).then(|| f.text.clone()),
                    tool_calls: calls.then(|| tools::message_calls(&f.tool_calls)),
                };
                Choice::Message { index: i, message, logprobs, finish_reason, prompt_logprobs }
            }
            Kind::Completion => {
                let mut text = if self.shape.echo { self.prompt_text(i) } else { String::new() };
                if !self.echo_only {
                    text.push_str(&f.text);
                }
                let finish_reason = Some(finish_reason);
                Choice::Text { index: i, text, logprobs, finish_reason, prompt_logprobs }
            }
        }
    }

    /// The whole answer (non-streaming).
    fn whole(&self, choices: &[Collected]) -> Envelope<'_> {
        let finals: Vec<&FinalEvent> = choices.iter().filter_map(|c| c.done.as_ref()).collect();
        let out = choices
            .iter()
            .zip(&finals)
            .enumerate()
            .map(|(i, (c, f))| self.choice(i, c, f))
            .collect();
        let mut v = self.envelope(false, out);
        v.usage = Some(Some(self.usage(&finals)));
        v
    }
}

/// A body as JSON text.
fn json_text(v: &impl serde::Serialize) -> String {
    serde_json::to_string(v).expect("the bodies serialize")
}

/// Queues each of `prompts` `n` times (choice i of prompt p with the seed + i, at index p·n + i),
/// all as one job, and answers as `shape` asks.
pub async fn run(
    h: Arc<Http>,
    kind: Kind,
    prompts: Vec<GenerateRequest>,
    shape: Shape,
) -> Result<Response, ApiError> {
    let echo_only = shape.echo && shape.max_tokens == Some(0);
    if shape.max_tokens == Some(0) && !shape.echo {
        return Err(ApiError::bad(
            "max_tokens",
            "max_tokens: must be at least 1 (0 only with echo)",
        ));
    }
    let chat = kind == Kind::Chat;
    let mut requests = Vec::with_capacity(prompts.len() * shape.n);
    let mut ids_of = Vec::with_capacity(prompts.len());
    for mut g in prompts {
        let ids = h.svc.input_ids(&g).map_err(|r| {
            let e = crate::Error::from(r);
            h.svc.metrics.rejected(e.reject_reason());
            ApiError::from_error(&e, chat)
        })?;
        // No limit given: what the context (and the KV cache) leaves after the prompt, as vLLM does.
        let room = h.svc.context.min(h.svc.kv_capacity).saturating_sub(ids.len()).max(1);
        g.max_new_tokens = if echo_only { 1 } else { shape.max_tokens.unwrap_or(room as u32) };
        g.input = Some(generate_request::Input::TokenIds(TokenIds { ids: ids.clone() }));
        let seed = g.sampling.as_ref().map_or(0, |s| s.seed);
        requests.extend((0..shape.n as u64).map(|i| {
            let mut r = g.clone();
            if let Some(s) = r.sampling.as_mut() {
                s.seed = seed.wrapping_add(i);
            }
            r
        }));
        ids_of.push(ids);
    }
    // A reconnecting stream continues only the job it was watching (found by its key): never
    // the tail of another generation after the part it has.
    let known = shape.idempotency_key.as_deref().is_some_and(|k| h.svc.jobs.by_key(k).is_some());
    if !shape.resume.is_empty() && !known {
        return Err(ApiError::bad(
            "Last-Event-ID",
            "Last-Event-ID: no job with this Idempotency-Key is held to continue; send the request \
             again without Last-Event-ID",
        ));
    }
    // The request's span is the root of its trace; the job span goes under it.
    let span =
        tracing::info_span!(parent: None, "http request", method = "POST", path = kind.path());
    let (job_id, trace_id) = h
        .svc
        .submit(&requests, shape.idempotency_key.as_deref(), shape.key)
        .instrument(span)
        .await
        .map_err(|e| ApiError::from_error(&e, chat))?;
    let rx =
        h.svc.watch(&job_id, true, &shape.resume).map_err(|e| ApiError::from_error(&e, chat))?;
    let a = Answer {
        id: format!("{}{}", kind.id_prefix(), job_id.trim_start_matches("job-")),
        h,
        kind,
        created: now_s(),
        shape,
        prompts: ids_of,
        echo_only,
    };
    let mut resp =
        if a.shape.stream { stream(a, rx).into_response() } else { whole(a, rx).await? };
    if let Ok(v) = HeaderValue::from_str(&trace_id) {
        resp.headers_mut().insert("x-trace-id", v);
    }
    Ok(resp)
}

type Events = mpsc::Receiver<Result<GenerateEvent, tonic::Status>>;

async fn whole(a: Answer, mut rx: Events) -> Result<Response, ApiError> {
    let mut choices: Vec<Collected> = (0..a.total()).map(|_| Collected::default()).collect();
    let mut left = a.total();
    while let Some(ev) = rx.recv().await {
        let ev = ev.map_err(|s| ApiError::failed(s.message()))?;
        let Some(c) = choices.get_mut(ev.index as usize) else { continue };
        match ev.event {
            Some(generate_event::Event::Token(t)) => {
                c.ids.extend(t.ids);
                c.lps.extend(t.logprobs);
                if !t.prompt_logprobs.is_empty() {
                    c.prompt = t.prompt_logprobs;
                }
            }
            Some(generate_event::Event::Done(f)) => {
                if f.finish_reason() == FinishReason::Error {
                    return Err(ApiError::failed(&f.error));
                }
                if c.done.replace(f).is_none() {
                    left -= 1;
                }
                if left == 0 {
                    return Ok(axum::Json(a.whole(&choices)).into_response());
                }
            }
            None => {}
        }
    }
    Err(ApiError::unavailable("the request ended without a result"))
}

impl Answer {
    /// What choice `i`'s token event `t` adds to the stream: its text (after the prompt's, the
    /// first time, when echoing) and log-probabilities; None while there is nothing to say (a stop
    /// string or a multi-byte character pending) or the text is held for tool calls.
    fn token_delta(
        &self,
        i: usize,
        c: &mut Collected,
        t: &layerstream_rpc::v1::TokenEvent,
    ) -> Option<(String, Option<Logprobs>)> {
        let first = !std::mem::replace(&mut c.started, true);
        let echo = (first && self.shape.echo).then_some(&t.prompt_logprobs[..]);
        let (ids, lps, text) = if self.echo_only {
            (&[][..], &[][..], String::new())
        } else {
            (&t.ids[..], &t.logprobs[..], t.text.clone())
        };
        let lp = self.logprobs(i, ids, lps, echo, &mut c.offset);
        let text = if echo.is_some() { self.prompt_text(i) + &text } else { text };
        // With tools the text waits for the end (the final event's text): it may be a call.
        let quiet = self.shape.tools || (text.is_empty() && lp.is_none());
        (!quiet).then_some((text, lp))
    }
}

fn stream(a: Answer, mut rx: Events) -> impl IntoResponse {
    let (tx, out) = mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(async move {
        let send_id = |body: String, id: Option<String>| {
            let tx = tx.clone();
            let mut ev = Event::default().data(body);
            if let Some(id) = id {
                ev = ev.id(id);
            }
            async move { tx.send(Ok(ev)).await.is_ok() }
        };
        let send = |body: String| send_id(body, None);
        let mut choices: Vec<Collected> = (0..a.total()).map(|_| Collected::default()).collect();
        // Each choice's tokens sent so far (with those a resumed client had): the `id:` of every
        // chunk that carries tokens, which a client sends back as `Last-Event-ID` to continue.
        let mut counts = a.shape.resume.clone();
        counts.resize(a.total(), 0);
        // The first chunk of each choice names the role (chat), as OpenAI's does.
        if a.kind == Kind::Chat {
            for i in 0..a.total() {
                let delta = Delta { role: Some("assistant"), ..Delta::text(String::new()) };
                if !send(a.chunk(i, delta, None, None, &counts)).await {
                    return;
                }
            }
        }
        let mut left = a.total();
        while let Some(ev) = rx.recv().await {
            let ev = match ev {
                Ok(ev) => ev,
                Err(s) => {
                    let _ = send(ApiError::failed(s.message()).json()).await;
                    break;
                }
            };
            let i = ev.index as usize;
            let Some(c) = choices.get_mut(i) else { continue };
            let ok = match ev.event {
                Some(generate_event::Event::Token(t)) => {
                    counts[i] += t.ids.len() as u32;
                    match a.token_delta(i, c, &t) {
                        Some(delta) => {
                            let id =
                                counts.iter().map(u32::to_string).collect::<Vec<_>>().join(".");
                            let (content, lp) = delta;
                            let chunk = a.chunk(i, Delta::text(content), lp, None, &counts);
                            send_id(chunk, Some(id)).await
                        }
                        None => true,
                    }
                }
                Some(generate_event::Event::Done(f)) => {
                    if f.finish_reason() == FinishReason::Error {
                        let _ = send(ApiError::failed(&f.error).json()).await;
                        break;
                    }
                    let mut ok = true;
                    if a.shape.tools {
                        // The text without any call markup, then the calls.
                        let text = (!f.text.is_empty() || f.tool_calls.is_empty())
                            .then(|| Delta::text(f.text.clone()));
                        let deltas = text.into_iter().chain(tools::delta_calls(&f.tool_calls));
                        for d in deltas {
                            ok = ok && send(a.chunk(i, d, None, None, &counts)).await;
                        }
                    }
                    let reason =
                        if a.echo_only { "length" } else { finish_name(f.finish_reason()) };
                    let last = a.chunk(i, Delta::default(), None, Some(reason), &counts);
                    ok = ok && send(last).await;
                    c.done = Some(f);
                    left -= 1;
                    if left == 0 {
                        if ok && a.shape.include_usage {
                            let finals: Vec<&FinalEvent> =
                                choices.iter().filter_map(|c| c.done.as_ref()).collect();
                            let mut u = a.envelope(true, Vec::new());
                            u.usage = Some(Some(a.usage(&finals)));
                            ok = send(json_text(&u)).await;
                        }
                        if ok {
                            let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
                        }
                        break;
                    }
                    ok
                }
                None => true,
            };
            if !ok {
                // The client went away: dropping `rx` cancels the job.
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(out)).keep_alive(KeepAlive::default())
}
