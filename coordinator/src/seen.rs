//! What a reconnecting watcher already has: `WatchJob.seen` counts each request's tokens, and the
//! events it covers are left out — an event it covers in part is cut, its text and log-probabilities
//! with it — so the client gets exactly the tokens it had not seen, however the events fell.

use layerstream_model::Tokenizer;
use layerstream_rpc::v1::{generate_event, GenerateEvent};
use std::sync::Arc;

/// Per request, the tokens still to leave out, and those already left out (to cut text).
pub struct Seen {
    left: Vec<u32>,
    before: Vec<Vec<u32>>,
    tok: Arc<Tokenizer>,
}

impl Seen {
    /// `seen[i]`: tokens of request `i` the client has.
    pub fn new(seen: &[u32], tok: Arc<Tokenizer>) -> Self {
        Seen { left: seen.to_vec(), before: vec![Vec::new(); seen.len()], tok }
    }

    /// The part of `ev` the client has not seen (None: it saw all of it).
    pub fn pass(&mut self, mut ev: GenerateEvent) -> Option<GenerateEvent> {
        let i = ev.index as usize;
        let left = self.left.get(i).copied().unwrap_or(0) as usize;
        let Some(generate_event::Event::Token(t)) = &mut ev.event else { return Some(ev) };
        if left == 0 {
            return Some(ev);
        }
        if left >= t.ids.len() {
            self.left[i] -= t.ids.len() as u32;
            self.before[i].extend(&t.ids);
            return None;
        }
        // Cut: the text of the tokens seen is the text this event's first `left` tokens add.
        let before = std::mem::take(&mut self.before[i]);
        let text_of = |ids: &[u32]| self.tok.decode(ids, true).unwrap_or_default();
        let base = text_of(&before);
        let upto = text_of(&[before.as_slice(), &t.ids[..left]].concat());
        let had = upto.strip_prefix(base.as_str()).unwrap_or("");
        t.text = t.text.strip_prefix(had).map_or_else(|| t.text.clone(), str::to_owned);
        t.ids.drain(..left);
        if t.logprobs.len() >= left {
            t.logprobs.drain(..left);
        }
        t.prompt_logprobs.clear();
        self.left[i] = 0;
        Some(ev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_rpc::v1::{FinalEvent, TokenEvent};

    fn tok() -> Arc<Tokenizer> {
        crate::test_tokenizer()
    }

    fn token(index: u32, tok: &Tokenizer, ids: &[u32], prev: &[u32]) -> GenerateEvent {
        let all = tok.decode(&[prev, ids].concat(), true).unwrap();
        let base = tok.decode(prev, true).unwrap();
        GenerateEvent {
            index,
            event: Some(generate_event::Event::Token(TokenEvent {
                ids: ids.to_vec(),
                text: all[base.len()..].to_owned(),
                ..Default::default()
            })),
        }
    }

    /// Seen counts tokens: whole events are left out, one covered in part is cut (ids and text),
    /// other requests and the final event pass; what the client had plus what it gets is the
    /// whole answer.
    #[test]
    fn a_watcher_gets_exactly_the_tokens_it_had_not_seen() {
        let t = tok();
        let ids = t.encode("The quick brown fox jumps over the lazy dog").unwrap();
        assert!(ids.len() >= 6);
        let (a, b) = (&ids[..3], &ids[3..]);
        let evs = [token(0, &t, a, &[]), token(1, &t, a, &[]), token(0, &t, b, a)];
        for had in 0..=ids.len() {
            let mut s = Seen::new(&[had as u32], t.clone());
            let mut got: Vec<u32> = ids[..had].to_vec();
            let mut text = t.decode(&ids[..had], true).unwrap();
            for ev in evs.iter().cloned() {
                let Some(out) = s.pass(ev) else { continue };
                if let (0, Some(generate_event::Event::Token(e))) = (out.index, out.event) {
                    got.extend(e.ids);
                    text.push_str(&e.text);
                } else {
                    assert_eq!(out.index, 1, "the other request passes whole");
                }
            }
            assert_eq!(got, ids, "seen {had}");
            assert_eq!(text, t.decode(&ids, true).unwrap(), "seen {had}");
        }
        let fin = GenerateEvent {
            index: 0,
            event: Some(generate_event::Event::Done(FinalEvent::default())),
        };
        assert!(Seen::new(&[5], t).pass(fin).is_some());
    }
}
