//! What the scheduler does for a request's output beyond sampling: the mask of its output format
//! for each step that samples (computed here, applied by the head worker), the tokens the format
//! forces (emitted without sampling, fed with the next step in one chunk), the prompt's
//! log-probabilities (scored by the head while the prompt is prefilled) and the tool calls parsed
//! from a finished output.

use super::active::Active;
use super::core::{Core, Event};
use layerstream_model::Tokenizer;
use layerstream_rpc::v1::{
    generate_event, GenerateEvent, StepSeq, TokenEvent, TokenLogprobs, ToolCall,
};
use layerstream_serving::FinishReason;
use std::time::Instant;

impl Core {
    /// Fills each sampling member's format mask (on several threads when several are
    /// constrained) and each prefilling member's ids to score.
    pub(super) fn outputs(
        &mut self,
        active: &mut [Active],
        members: &[(usize, usize)],
        seqs: &mut [StepSeq],
    ) {
        let mut want = vec![false; active.len()];
        for (&(i, _), s) in members.iter().zip(seqs.iter_mut()) {
            let a = &active[i];
            if let Some(k) = a.req.params.prompt_logprobs {
                // Row r scores the token after position start + r, while that is a prompt token.
                let (start, prompt) = (s.start_pos as usize, &a.req.input_ids);
                if a.scores.len() + 1 < prompt.len() {
                    let end = (start + s.token_ids.len()).min(prompt.len() - 1);
                    s.score_ids = (start..end).map(|p| prompt[p + 1]).collect();
                    s.score_top = k as u32;
                }
            }
            want[i] = !s.prompt_continues && a.req.constraint.is_some();
        }
        // Each constrained sequence's mask, computed where its sequence is held.
        let mut jobs: Vec<(usize, &mut Active)> =
            active.iter_mut().enumerate().filter(|(i, _)| want[*i]).collect();
        if jobs.is_empty() {
            return;
        }
        let masks: Vec<(usize, Vec<u32>, f64)> = if jobs.len() < MASK_THREADS_FROM {
            jobs.iter_mut().map(|(i, a)| mask_of(*i, a)).collect()
        } else {
            let per = jobs.len().div_ceil(MASK_THREADS);
            std::thread::scope(|scope| {
                let handles: Vec<_> = jobs
                    .chunks_mut(per)
                    .map(|chunk| {
                        scope.spawn(move || {
                            chunk.iter_mut().map(|(i, a)| mask_of(*i, a)).collect::<Vec<_>>()
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().expect("a mask thread panicked"))
                    .collect()
            })
        };
        for (i, mask, secs) in masks {
            self.metrics.mask(secs);
            if let Some(s) = members.iter().position(|m| m.0 == i).and_then(|k| seqs.get_mut(k)) {
                s.allowed = mask;
            }
        }
    }
}

/// Constrained sequences in a step from which their masks are computed on several threads.
const MASK_THREADS_FROM: usize = 4;
/// Threads computing a step's masks.
const MASK_THREADS: usize = 4;

/// Sequence `i`'s mask and the seconds it took.
fn mask_of(i: usize, a: &mut Active) -> (usize, Vec<u32>, f64) {
    let t0 = Instant::now();
    let c = a.req.constraint.as_mut().expect("constrained");
    let mask = c.mask().unwrap_or_else(|e| {
        // Not seen in practice: end the output as the format would.
        tracing::warn!(seq = a.req.seq_id, error = %e, "output format failed; ending the output");
        eos_only(&a.req.params.sampling.eos_ids)
    });
    (i, mask, t0.elapsed().as_secs_f64())
}

/// A mask allowing only the end-of-sequence tokens.
fn eos_only(eos: &[u32]) -> Vec<u32> {
    let mut m = vec![0u32; eos.iter().max().map_or(1, |&e| e as usize / 32 + 1)];
    for &e in eos {
        m[e as usize / 32] |= 1 << (e % 32);
    }
    m
}

/// Keeps the scores of a step that started at `start`: position `start + r`'s score, when it is
/// the next one missing (a replayed prompt scores again what is already kept).
pub(super) fn take_scores(a: &mut Active, start: usize, scores: &[TokenLogprobs]) {
    for (r, sc) in scores.iter().enumerate() {
        if start + r == a.scores.len() {
            a.scores.push(sc.clone());
        }
    }
}

/// Feeds one output token to the stop criteria and the format; the text it completes goes to
/// `text`. Returns how the output ended, if it did.
pub(super) fn push(
    tok: &Tokenizer,
    a: &mut Active,
    id: u32,
    text: &mut String,
) -> Option<(FinishReason, String)> {
    let mut reason = stop(tok, a, id, text);
    if let Some(c) = a.req.constraint.as_mut() {
        if let Err(e) = c.advance(id) {
            reason = reason.or(Some((FinishReason::Error, format!("output format: {e}"))));
        }
    }
    reason
}

/// A request resumed from the journal: its journaled events' tokens are fed to the stop criteria
/// and format (as if it had just produced them) and shown again event by event, with the text
/// they completed; it then continues as a sequence replayed after a fault does (its prompt and
/// output prefilled). Returns how the output ended, when the journal held its end already.
pub(super) fn replay(
    tok: &Tokenizer,
    a: &mut Active,
    events: &mut Vec<Event>,
) -> Option<(FinishReason, String)> {
    for ids in std::mem::take(&mut a.req.journaled) {
        let mut text = String::new();
        let mut reason = None;
        for &id in &ids {
            reason = reason.or(push(tok, a, id, &mut text));
        }
        let ev = GenerateEvent {
            index: a.req.index,
            event: Some(generate_event::Event::Token(TokenEvent {
                ids,
                text,
                logprobs: Vec::new(),
                prompt_logprobs: Vec::new(),
            })),
        };
        events.push(Event { to: a.req.events.clone(), ev, try_only: false });
        if reason.is_some() {
            return reason;
        }
    }
    None
}

/// Feeds one output token to the stop criteria only.
fn stop(
    tok: &Tokenizer,
    a: &mut Active,
    id: u32,
    text: &mut String,
) -> Option<(FinishReason, String)> {
    match a.stopper.push(tok, id) {
        Ok(p) => {
            text.push_str(&p.delta);
            p.finish.map(|r| (r, String::new()))
        }
        Err(e) => Some((FinishReason::Error, format!("decoding output: {e}"))),
    }
}

/// After a step's tokens: a format that is complete ends the output (nothing else may follow);
/// tokens it forces are emitted now and go into the caches with the next step, in one chunk.
pub(super) fn follow_format(
    tok: &Tokenizer,
    a: &mut Active,
    ids: &mut Vec<u32>,
    text: &mut String,
) -> Option<(FinishReason, String)> {
    let c = a.req.constraint.as_mut()?;
    if c.finished() {
        return Some((FinishReason::Stop, String::new()));
    }
    let forced = c.forced();
    if forced.is_empty() {
        return None;
    }
    a.refeed = true;
    for t in forced {
        ids.push(t);
        a.forced += 1;
        if let Some(r) = stop(tok, a, t, text) {
            return Some(r);
        }
    }
    a.req.constraint.as_ref().filter(|c| c.finished()).map(|_| (FinishReason::Stop, String::new()))
}

/// A request with tools that stopped: the calls in its output become `tool_calls` (the reason
/// `tool_calls`), the text before them its text; an output without calls stays text. One that
/// ended inside a call (cut by its length, or malformed) keeps the calls it holds, the last with
/// the arguments written so far (the reason stays `length`) — its markup never reaches the text.
/// Where at most one call was asked for, only the first is kept.
pub(super) fn tool_calls(tok: &Tokenizer, a: &Active, ev: &mut GenerateEvent) {
    use layerstream_serving::tools::{parse, parse_cut, CallText, ToolFormat};
    let Some(reading) = &a.req.tools else { return };
    let Some(generate_event::Event::Done(f)) = ev.event.as_mut() else { return };
    let reason = f.finish_reason();
    if reason != FinishReason::Stop && reason != FinishReason::Length {
        return;
    }
    let eos = &a.req.params.sampling.eos_ids;
    let out = a.stopper.output();
    let body = match out.last() {
        Some(t) if eos.contains(t) => &out[..out.len() - 1],
        _ => out,
    };
    let Ok(raw) = tok.decode(body, false) else { return };
    let format = reading.format;
    let whole = (reason == FinishReason::Stop)
        .then(|| parse(format, &raw))
        .flatten()
        .map(|(c, calls)| (c, calls.into_iter().map(CallText::from).collect::<Vec<_>>()));
    let Some((content, mut calls)) = whole.or_else(|| parse_cut(format, &raw)) else { return };
    // Llama 3 calls have no tag: JSON that names no offered function (an answer whose first key
    // is `name`) is text. Tagged calls stay calls, whatever they name (as vLLM returns them).
    if format == ToolFormat::Llama3Json && calls.iter().any(|c| !reading.names.contains(&c.name)) {
        return;
    }
    if reading.one {
        calls.truncate(1);
    }
    let mistral = format == ToolFormat::Mistral;
    f.tool_calls = calls
        .into_iter()
        .map(|c| {
            let hex = layerstream_rpc::auth::random_hex();
            // Mistral's templates take ids of exactly nine letters and digits.
            let id = if mistral { hex[..9].to_owned() } else { format!("call_{}", &hex[..24]) };
            ToolCall { id, name: c.name, arguments: c.arguments }
        })
        .collect();
    f.text = content;
    if reason == FinishReason::Stop && !f.tool_calls.is_empty() {
        f.set_finish_reason(FinishReason::ToolCalls);
    }
}
