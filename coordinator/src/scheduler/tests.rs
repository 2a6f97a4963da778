//! The scheduler's decisions driven with made-up step results, no worker and no process: admission
//! and chunked prefill, KV blocks running dry (host tier or replay), prefix hits, drafts rejected
//! and a tree's accepted path, a worker fault, a format ending a sequence, cancellation.

use super::*;
use crate::pipeline::StepResult;
use layerstream_model::Tokenizer;
use layerstream_rpc::v1::{generate_event, SeqResult};
use layerstream_serving::grammar::{Format, Grammars};
use layerstream_serving::spec::SpecMode;
use layerstream_serving::FinishReason;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The SmolLM2 tokenizer of the tiny Llama fixture (end of sequence: 2).
fn tokenizer() -> Arc<Tokenizer> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/tiny-llama");
    Arc::new(Tokenizer::from_file(&dir.join("tokenizer.json"), None, None, Some(2)).unwrap())
}

fn limits(max_batch: usize, kv_capacity: usize, step: usize, host_blocks: usize) -> Limits {
    Limits {
        max_batch,
        kv_capacity,
        max_step_tokens: step,
        kv_block: 4,
        host_blocks,
        prefix_cache: false,
    }
}

const NO_SPEC: SpecConfig = SpecConfig { mode: SpecMode::Off, max: 0, width: 1 };

/// A core over `limits` and the test tokenizer, with its waiting counter.
fn core(limits: Limits, spec: SpecConfig) -> (Core, Arc<AtomicUsize>) {
    let waiting = Arc::new(AtomicUsize::new(0));
    let core = Core::new(CoreParts {
        tokenizer: tokenizer(),
        waiting_count: waiting.clone(),
        eos: vec![2],
        limits,
        max_recoveries: 2,
        metrics: Arc::new(crate::metrics::Metrics::new()),
        spec,
    });
    (core, waiting)
}

/// A request for sequence `id` (its events carry `id` as their index), and its stream.
fn request(id: u64, prompt: &[u32], max_new: usize) -> (SeqRequest, mpsc::Receiver<GenerateEvent>) {
    let (tx, rx) = mpsc::channel(64);
    let params = GenerateParams { max_new_tokens: max_new, ..Default::default() };
    let req = SeqRequest {
        seq_id: id,
        index: id as u32,
        input_ids: prompt.to_vec(),
        params,
        events: tx,
        span: Span::none(),
        trace_id: format!("t{id}"),
        cancel: Arc::new(AtomicBool::new(false)),
        queued: Instant::now(),
        constraint: None,
        tools: None,
        salt: 0,
        journaled: Vec::new(),
    };
    (req, rx)
}

/// What one turn of the shell's loop did.
#[derive(Default)]
struct Turn {
    sent: Vec<StepSeq>,
    release: Vec<u64>,
    swaps: Option<(self::core::Moves, self::core::Moves)>,
    events: Vec<GenerateEvent>,
}

impl Turn {
    /// (index, token ids) of the token events, in order.
    fn tokens(&self) -> Vec<(u32, Vec<u32>)> {
        let token = |e: &GenerateEvent| match &e.event {
            Some(generate_event::Event::Token(t)) => Some((e.index, t.ids.clone())),
            _ => None,
        };
        self.events.iter().filter_map(token).collect()
    }

    /// (index, reason) of the final events, in order.
    fn ends(&self) -> Vec<(u32, FinishReason)> {
        let done = |e: &GenerateEvent| match &e.event {
            Some(generate_event::Event::Done(f)) => Some((e.index, f.finish_reason())),
            _ => None,
        };
        self.events.iter().filter_map(done).collect()
    }

    /// The step entry of sequence `id`.
    fn seq(&self, id: u64) -> &StepSeq {
        self.sent.iter().find(|s| s.seq_id == id).expect("rode the step")
    }

    /// (id, start, tokens, prompt continues) of every sequence sent.
    fn shape(&self) -> Vec<(u64, u32, usize, bool)> {
        let s = &self.sent;
        s.iter().map(|s| (s.seq_id, s.start_pos, s.token_ids.len(), s.prompt_continues)).collect()
    }
}

/// One turn as the shell runs it, every step answered by `answer`.
fn turn(c: &mut Core, answer: impl Fn(&StepSeq) -> SeqResult) -> Turn {
    let mut t = Turn::default();
    let deliver = |t: &mut Turn, evs: Vec<Event>| t.events.extend(evs.into_iter().map(|e| e.ev));
    let evs = c.admit();
    deliver(&mut t, evs);
    let evs = c.drop_cancelled();
    deliver(&mut t, evs);
    c.make_room();
    t.swaps = c.take_swaps();
    for step in c.plan(1) {
        let seqs = step.seqs.clone();
        let result = StepResult { seqs: seqs.iter().map(&answer).collect(), ..Default::default() };
        t.release.extend(step.release.iter().copied());
        let evs = c.apply(step.lane, &seqs, Duration::from_millis(10), Ok(result));
        deliver(&mut t, evs);
        t.sent.extend(seqs);
    }
    t
}

/// Every sequence gets `token` (one each, no draft taken).
fn each(token: u32) -> impl Fn(&StepSeq) -> SeqResult {
    move |s| SeqResult { seq_id: s.seq_id, tokens: vec![token], ..Default::default() }
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 100 + i).collect()
}

#[test]
fn admission_follows_the_batch_limit_and_long_prompts_are_chunked() {
    let (mut c, waiting) = core(limits(2, 256, 8, 0), NO_SPEC);
    let mut streams = Vec::new();
    for (id, n, max_new) in [(1, 12, 2), (2, 3, 1), (3, 3, 1)] {
        let (r, rx) = request(id, &prompt(n), max_new);
        streams.push(rx);
        waiting.fetch_add(1, Ordering::SeqCst);
        c.enqueue(r);
    }
    // Two admitted; the first prompt takes the whole step budget, the second sits out.
    let t = turn(&mut c, each(7));
    assert_eq!(t.shape(), vec![(1, 0, 8, true)]);
    assert!(t.events.is_empty(), "a prompt chunk samples nothing");
    assert_eq!((c.running(), waiting.load(Ordering::SeqCst)), (2, 1));
    // The rest of the first prompt and the whole second ride one step; both sample.
    let t = turn(&mut c, each(7));
    assert_eq!(t.shape(), vec![(1, 8, 4, false), (2, 0, 3, false)]);
    assert!(t.seq(1).sampling.is_none() && t.seq(2).sampling.is_some());
    assert_eq!(t.tokens(), vec![(1, vec![7]), (2, vec![7])]);
    assert_eq!(t.ends(), vec![(2, FinishReason::Length)]);
    // The finished one is freed by the next step and the third takes its place.
    let t = turn(&mut c, each(9));
    assert_eq!(t.release, vec![2]);
    assert_eq!(t.shape(), vec![(1, 12, 1, false), (3, 0, 3, false)]);
    assert_eq!(t.seq(1).token_ids, vec![7], "a decode feeds the last output token");
    assert_eq!(t.ends(), vec![(1, FinishReason::Length), (3, FinishReason::Length)]);
    assert!(c.idle());
}

/// Two sequences of 7-token prompts fill a pool of four 4-position blocks; at position 8 both
/// need a third block and the newer one gives its blocks up.
fn fill_the_pool(host_blocks: usize) -> (Core, Vec<mpsc::Receiver<GenerateEvent>>, Turn) {
    let (mut c, _) = core(limits(4, 16, 64, host_blocks), NO_SPEC);
    let mut streams = Vec::new();
    for (id, max_new) in [(1, 3), (2, 10)] {
        let (r, rx) = request(id, &prompt(7), max_new);
        streams.push(rx);
        c.enqueue(r);
    }
    assert_eq!(turn(&mut c, each(5)).shape(), vec![(1, 0, 7, false), (2, 0, 7, false)]);
    assert_eq!(turn(&mut c, each(6)).shape(), vec![(1, 7, 1, false), (2, 7, 1, false)]);
    let t = turn(&mut c, each(8));
    assert_eq!(t.shape(), vec![(1, 8, 1, false)], "the newer sequence is preempted");
    assert_eq!(t.ends(), vec![(1, FinishReason::Length)]);
    (c, streams, t)
}

#[test]
fn a_dry_pool_preempts_the_newest_to_the_host_tier_and_resumes_it_where_it_was() {
    let (mut c, _streams, t) = fill_the_pool(8);
    let (out, back) = t.swaps.expect("its blocks are copied out");
    assert_eq!((out.len(), back.len()), (2, 0));
    assert!(t.release.is_empty(), "the workers keep nothing to forget");
    let t = turn(&mut c, each(9));
    let (out2, back) = t.swaps.clone().expect("and copied back");
    assert!(out2.is_empty());
    assert_eq!(
        back.iter().map(|m| m.0).collect::<Vec<_>>(),
        out.iter().map(|m| m.1).collect::<Vec<_>>()
    );
    assert_eq!(t.shape(), vec![(2, 8, 1, false)], "it continues at its position");
    assert_eq!(t.seq(2).token_ids, vec![6]);
    assert_eq!(t.seq(2).blocks.len(), 3);
}

#[test]
fn without_a_host_tier_the_preempted_sequence_is_replayed_from_its_prompt() {
    let (mut c, _streams, t) = fill_the_pool(0);
    assert!(t.swaps.is_none());
    assert_eq!(t.release, vec![2], "the workers forget the preempted one's cache");
    let t = turn(&mut c, each(9));
    assert_eq!(t.release, vec![1], "and the finished one's");
    assert_eq!(t.shape(), vec![(2, 0, 8, true)], "its prompt and first output, sampling nothing");
    let s = t.seq(2);
    assert_eq!(s.token_ids, [prompt(7), vec![5]].concat());
    assert_eq!(s.draws_before, 2, "its generator is where two draws left it");
    let t = turn(&mut c, each(9));
    assert_eq!(t.shape(), vec![(2, 8, 1, false)]);
    assert_eq!(t.tokens(), vec![(2, vec![9])]);
}

#[test]
fn a_prompt_in_the_prefix_cache_starts_after_its_cached_blocks() {
    let (mut c, _) = core(Limits { prefix_cache: true, ..limits(4, 256, 64, 0) }, NO_SPEC);
    let (a, _ra) = request(1, &prompt(10), 1);
    c.enqueue(a);
    assert_eq!(turn(&mut c, each(5)).ends(), vec![(1, FinishReason::Length)]);
    let (b, _rb) = request(2, &prompt(10), 1);
    c.enqueue(b);
    let t = turn(&mut c, each(5));
    assert_eq!(t.shape(), vec![(2, 8, 2, false)], "two full blocks found");
    assert_eq!(t.seq(2).cached_ids, prompt(8));
    assert!(t.seq(2).sampling.is_some(), "its first step carries its sampling");
}

#[test]
fn a_rejected_draft_is_cut_and_the_sequence_goes_on_after_the_accepted_tokens() {
    let spec = SpecConfig { mode: SpecMode::Ngram, max: 4, width: 1 };
    let (mut c, _) = core(limits(4, 256, 64, 0), spec);
    c.cost.record(1, 10.0);
    let p: Vec<u32> = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7].to_vec();
    let (r, _rx) = request(1, &p, 20);
    c.enqueue(r);
    turn(&mut c, each(8));
    // The history ends 5 6 7 8: prompt lookup drafts what followed it before.
    let answer =
        |s: &StepSeq| SeqResult { seq_id: s.seq_id, tokens: vec![5, 40], ..Default::default() };
    let t = turn(&mut c, answer);
    let s = t.seq(1);
    assert!(s.draft_len >= 2, "drafted {}", s.draft_len);
    assert_eq!(s.token_ids[..3], [8, 5, 6]);
    assert_eq!(t.tokens(), vec![(1, vec![5, 40])], "one accepted draft, then the target's token");
    let t = turn(&mut c, each(3));
    let s = t.seq(1);
    assert_eq!((s.start_pos as usize, s.token_ids[0]), (p.len() + 2, 40));
}

#[test]
fn a_trees_accepted_path_goes_in_again_with_the_next_token() {
    let spec = SpecConfig { mode: SpecMode::Draft, max: 4, width: 2 };
    let (mut c, _) = core(limits(4, 256, 64, 0), spec);
    c.cost.record(1, 10.0);
    let p = prompt(6);
    let (r, _rx) = request(1, &p, 20);
    c.enqueue(r);
    // The head's draft model proposes a tree: 20 and 21 after the token, 22 after 20.
    let first = |s: &StepSeq| SeqResult {
        seq_id: s.seq_id,
        tokens: vec![8],
        drafts: vec![20, 21, 22],
        draft_parents: vec![0, 0, 1],
        ..Default::default()
    };
    let t = turn(&mut c, first);
    assert!(t.seq(1).draft_next > 0, "the head is asked to draft");
    let t = turn(&mut c, |s| SeqResult {
        seq_id: s.seq_id,
        tokens: vec![20, 30],
        ..Default::default()
    });
    let s = t.seq(1);
    assert!(!s.tree_parents.is_empty() && s.draft_len >= 2, "a tree of {}", s.draft_len);
    assert_eq!(s.token_ids[..3], [8, 20, 21]);
    let t = turn(&mut c, each(31));
    let s = t.seq(1);
    assert_eq!((s.start_pos as usize, s.token_ids.clone()), (p.len() + 1, vec![20, 30]));
    assert!(!s.prompt_continues, "the branch and the new token sample as one chunk");
}

#[test]
fn a_worker_fault_replays_every_sequence_and_repeated_faults_end_them() {
    let (mut c, _) = core(limits(4, 256, 64, 0), NO_SPEC);
    let (r, _rx) = request(1, &prompt(5), 10);
    c.enqueue(r);
    turn(&mut c, each(9));
    let step = c.plan(1).pop().expect("a decode");
    let fault = crate::Error::Worker { worker: "w1".into(), msg: "gone".into() };
    assert!(c.apply(step.lane, &step.seqs, Duration::ZERO, Err(fault)).is_empty());
    assert!(c.fault_pending());
    let e = c.take_fault().expect("nothing in flight");
    assert_eq!(c.recovery(&e), Recovery::Replay { probe_only: false });
    c.replay_all();
    let t = turn(&mut c, each(9));
    assert_eq!(t.shape(), vec![(1, 0, 5, true)], "replayed from its prompt");
    assert_eq!(t.seq(1).draws_before, 1);
    assert_eq!(turn(&mut c, each(4)).shape(), vec![(1, 5, 1, false)]);
    // A stalled worker is probed, not waited for; past --max-recoveries (2) in a row the
    // sequences end.
    let timeout = crate::Error::StepTimeout { worker: "w1".into(), timeout: Duration::ZERO };
    for _ in 0..2 {
        assert_eq!(c.recovery(&timeout), Recovery::Replay { probe_only: true });
    }
    let Recovery::Fail(msg) = c.recovery(&timeout) else { panic!("a third fault in a row") };
    assert!(msg.contains("after 2 recoveries in a row"), "{msg}");
    let (events, ids) = c.fail_all(&msg);
    assert_eq!(ids, vec![1]);
    let Some(generate_event::Event::Done(f)) = &events[0].ev.event else { panic!("an end") };
    assert_eq!((f.finish_reason(), f.output_ids.clone()), (FinishReason::Error, vec![9, 4]));
    assert!(c.idle());
}

#[test]
fn a_format_that_is_complete_ends_its_sequence() {
    let tok = tokenizer();
    let grammars = Grammars::new(tok.clone(), &[2]).unwrap();
    let (mut c, _) = core(limits(4, 256, 64, 0), NO_SPEC);
    let (mut r, _rx) = request(1, &prompt(4), 50);
    r.constraint = Some(Box::new(grammars.compile(&Format::Regex("yes".into())).unwrap()));
    c.enqueue(r);
    let yes = tok.encode_with("yes", false).unwrap();
    let t = turn(&mut c, each(yes[0]));
    assert!(!t.seq(1).allowed.is_empty(), "the step carries the format's mask");
    assert_eq!(t.ends(), vec![(1, FinishReason::Stop)]);
    let Some(generate_event::Event::Done(f)) = &t.events.last().unwrap().event else { panic!() };
    assert_eq!(f.text, "yes");
}

#[test]
fn cancelled_requests_end_waiting_or_between_their_steps() {
    let (mut c, waiting) = core(limits(1, 256, 64, 0), NO_SPEC);
    let (a, _ra) = request(1, &prompt(4), 10);
    let (b, _rb) = request(2, &prompt(4), 10);
    let (ca, cb) = (a.cancel.clone(), b.cancel.clone());
    waiting.store(2, Ordering::SeqCst);
    c.enqueue(a);
    c.enqueue(b);
    assert!(c.admit().is_empty());
    let step = c.plan(1).pop().expect("the first runs");
    // Cancelled while its step is in flight: it ends once the step is back.
    ca.store(true, Ordering::SeqCst);
    cb.store(true, Ordering::SeqCst);
    let ends =
        |evs: Vec<Event>| evs.into_iter().map(|e| (e.ev.index, e.try_only)).collect::<Vec<_>>();
    assert_eq!(ends(c.drop_cancelled()), vec![(2, true)], "the waiting one ends now");
    assert_eq!(waiting.load(Ordering::SeqCst), 0);
    let result = StepResult { seqs: step.seqs.iter().map(each(9)).collect(), ..Default::default() };
    c.apply(step.lane, &step.seqs, Duration::ZERO, Ok(result));
    assert_eq!(ends(c.drop_cancelled()), vec![(1, true)]);
    assert_eq!((c.running(), c.take_release()), (0, vec![1]));
}

#[test]
fn a_workers_result_that_does_not_fit_its_step_is_refused_naming_what() {
    let sent = |draft_len: u32, draft_next: u32, scores: usize| StepSeq {
        seq_id: 4,
        token_ids: vec![1; 1 + draft_len as usize],
        draft_len,
        draft_next,
        score_ids: vec![3; scores],
        ..Default::default()
    };
    let got = |tokens: usize, drafts: usize, parents: Vec<u32>| SeqResult {
        seq_id: 4,
        tokens: vec![1; tokens],
        drafts: vec![5; drafts],
        draft_parents: parents,
        ..Default::default()
    };
    let check = |s: StepSeq, r: Vec<SeqResult>| crate::pipeline::check_results(&[s], r);
    assert!(check(sent(2, 2, 0), vec![got(3, 2, vec![0, 0])]).is_ok());
    let cases = [
        (check(sent(0, 0, 0), vec![]), "0 results for 1 sequences"),
        (check(sent(0, 0, 0), vec![got(2, 0, vec![])]), "2 tokens after a draft of 0"),
        (check(sent(0, 0, 0), vec![got(0, 0, vec![])]), "0 tokens"),
        (check(sent(0, 1, 0), vec![got(1, 2, vec![0, 1])]), "2 drafted tokens with 2 parents"),
        (check(sent(0, 2, 0), vec![got(1, 2, vec![0, 2])]), "parent follows its child"),
        (check(sent(0, 0, 2), vec![got(1, 0, vec![])]), "0 scores for 2 ids"),
        (
            check(sent(0, 0, 0), vec![SeqResult { seq_id: 9, ..got(1, 0, vec![]) }]),
            "for sequence 9",
        ),
    ];
    for (res, want) in cases {
        let e = res.expect_err(want);
        assert!(e.contains(want), "{e} should say {want}");
    }
}
