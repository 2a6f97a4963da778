//! One step's round trip: `launch` fills each lane's step from its sequences (prefill chunks,
//! decodes, drafts, masks) and sends it; `landed` takes the result — tokens, drafts accepted,
//! scores, stops, grammar, events — and frees what finished.

use super::*;

impl Scheduler {
    /// Starts a step for every lane with no step in flight and sequences to run (the lanes refilled
    /// first, see `lanes::place`).
    pub(super) fn launch(&mut self, active: &mut [Active], fl: &mut Flight) {
        let m = self.pipeline.micro_batches.max(1);
        if fl.busy.len() != m {
            // The plan changed the count (only ever with nothing in flight).
            fl.busy = vec![false; m];
            self.metrics.micro_batches.set(m as i64);
        }
        let placed =
            crate::lanes::place(&active.iter().map(|a| a.lane).collect::<Vec<_>>(), &fl.busy);
        for (a, l) in active.iter_mut().zip(placed) {
            a.lane = l;
        }
        for lane in 0..m {
            if fl.busy[lane] {
                continue;
            }
            let idx: Vec<usize> =
                (0..active.len()).filter(|&i| active[i].lane == Some(lane)).collect();
            if idx.is_empty() {
                continue;
            }
            let shares = step_tokens(
                &idx.iter().map(|&i| (active[i].pos, active[i].prefill_end())).collect::<Vec<_>>(),
                self.limits.max_step_tokens,
            );
            // (sequence, tokens it brings) for the sequences that ride this step.
            let members: Vec<(usize, usize)> =
                idx.into_iter().zip(shares).filter(|&(_, n)| n > 0).collect();
            let mut seqs: Vec<StepSeq> = members
                .iter()
                .map(|&(i, n)| {
                    let a = &active[i];
                    StepSeq {
                        seq_id: a.req.seq_id,
                        start_pos: a.pos as u32,
                        token_ids: a.tokens(n),
                        sampling: (a.pos == a.base).then(|| a.req.params.sampling.to_wire()),
                        // Only the chunk that reaches the last known token samples; a replay's
                        // chunks (prompt and earlier outputs) sample nothing.
                        prompt_continues: a.pos + n < a.known(),
                        // Each output token drew once from a sampling sequence's generator.
                        draws_before: if a.pos == a.base {
                            (a.stopper.output().len() - a.forced) as u32
                        } else {
                            0
                        },
                        draft_len: 0,
                        draft_next: 0,
                        tree_parents: Vec::new(),
                        draft_width: 0,
                        blocks: Vec::new(),
                        cached_ids: if a.pos == a.base && a.base > 0 {
                            a.req.input_ids[..a.base].to_vec()
                        } else {
                            Vec::new()
                        },
                        allowed: Vec::new(),
                        score_ids: Vec::new(),
                        score_top: 0,
                    }
                })
                .collect();
            self.outputs(active, &members, &mut seqs);
            self.draft(active, &members, &mut seqs);
            // KV blocks for every position of the step: a draft the pool cannot hold is dropped,
            // a sequence it cannot hold at all sits this step out.
            let mut keep = vec![true; seqs.len()];
            for (k, (&(i, _), s)) in members.iter().zip(seqs.iter_mut()).enumerate() {
                let a = &mut active[i];
                if !self.grow(a, a.pos + s.token_ids.len()) {
                    let drafted = s.draft_len as usize;
                    s.token_ids.truncate(s.token_ids.len() - drafted);
                    (s.draft_len, s.tree_parents) = (0, Vec::new());
                    keep[k] = self.grow(a, a.pos + s.token_ids.len());
                }
                s.blocks = a.blocks.table.clone();
            }
            let mut it = keep.iter();
            let members: Vec<(usize, usize)> =
                members.into_iter().filter(|_| *it.next().expect("one each")).collect();
            let mut it = keep.iter();
            seqs.retain(|_| *it.next().expect("one each"));
            if seqs.is_empty() {
                continue;
            }
            let rows: usize = seqs.iter().map(|s| s.token_ids.len()).sum();
            // One `step` span per request in the step, so each request's trace shows every step it
            // rode; the first carries the workers' spans, the others link to it.
            let drafted: u32 = seqs.iter().map(|s| s.draft_len).sum();
            let spans: Vec<Span> = members.iter().map(|&(i, _)| info_span!(parent: &active[i].req.span, "step", batch = seqs.len() as i64, rows = rows as i64, micro_batch = lane as i64, spec = drafted as i64)).collect();
            for s in &spans[1..] {
                layerstream_telemetry::link(s, &spans[0]);
            }
            let runner = self.pipeline.runner(rows);
            let release = std::mem::take(&mut fl.release);
            self.metrics.launched(fl.busy.iter().filter(|&&b| b).count());
            fl.busy[lane] = true;
            fl.set.spawn(async move {
                let started = Instant::now();
                let res = runner.step(seqs.clone(), release, spans[0].clone(), lane).await;
                drop(spans);
                Landed { lane, seqs, started, res }
            });
        }
    }

    /// Takes a finished micro-batch step: its tokens go to their requests (finished ones end and are
    /// freed by the next step); a failure is kept for recovery once every step in flight is back.
    pub(super) async fn landed(
        &mut self,
        done: Result<Landed, tokio::task::JoinError>,
        active: &mut Vec<Active>,
        fl: &mut Flight,
    ) {
        let done = match done {
            Ok(d) => d,
            Err(e) => {
                // Not seen in practice: a step task panicked. Recover like any failed step.
                fl.fault.get_or_insert(crate::Error::Setup(format!("a step task failed: {e}")));
                return;
            }
        };
        if let Some(b) = fl.busy.get_mut(done.lane) {
            *b = false;
        }
        let out = match done.res {
            Ok(out) => out,
            Err(e) => {
                fl.fault.get_or_insert(e);
                return;
            }
        };
        let took = done.started.elapsed();
        let rows = done.seqs.iter().map(|s| s.token_ids.len()).sum();
        self.pipeline.deadline.record(took, rows);
        if fl.fault.is_none() {
            self.failures = 0;
        }
        let seqs = &done.seqs;
        self.metrics.step(
            seqs.len(),
            seqs.iter().map(|s| s.token_ids.len()).sum(),
            took.as_secs_f64() * 1e3,
            &out.workers,
        );
        // Each worker's wall time in this step counts as busy time for every running request: with
        // micro-batches, the workers are busy with the others' steps too.
        let walls: Vec<f64> = out.workers.iter().map(|w| w.wall_ms).collect();
        for a in active.iter_mut() {
            a.acc.add_busy(&walls);
        }
        let rows: usize = seqs.iter().map(|s| s.token_ids.len()).sum();
        if seqs.iter().all(|s| s.token_ids.len() == 1 + s.draft_len as usize) {
            // Decode steps only (a prefill's time says little about a draft's), drafting excluded.
            self.cost.record(rows, (took.as_secs_f64() * 1e3 - out.draft_ms).max(0.0));
        }
        if out.draft_level_ms > 0.0 {
            self.draft_ms = out.draft_level_ms;
        }
        let mut done_ids = Vec::new();
        for (k, (s, toks)) in seqs.iter().zip(&out.tokens).enumerate() {
            let id = s.seq_id;
            let Some(a) = active.iter_mut().find(|a| a.req.seq_id == id) else { continue };
            let drafted = s.draft_len as usize;
            let accepted = toks.len() - 1;
            // Rejected drafts are not in the caches any more (cut by the next step); after a tree,
            // neither is the accepted branch (it goes in again, in order, with the next token).
            a.refeed = !s.tree_parents.is_empty();
            a.pos += if a.refeed {
                s.token_ids.len() - drafted
            } else {
                s.token_ids.len() - (drafted - accepted.min(drafted))
            };
            self.settle(a);
            a.acc.add(&out.layers, out.layers_ms, seqs.len());
            if let Some(sc) = out.scores.get(k) {
                output::take_scores(a, s.start_pos as usize, sc);
            }
            if s.prompt_continues {
                continue;
            }
            a.next_draft = out.drafts.get(k).cloned().unwrap_or_default();
            if drafted > 0 {
                a.acceptance.record(levels(&s.tree_parents, drafted), accepted);
                self.metrics.speculated(drafted, accepted);
            }
            a.acc.spec(drafted, accepted);
            if a.stopper.output().is_empty() {
                a.acc.first_token = Some(a.req.queued.elapsed());
            }
            let wanted = a.req.params.sampling.logprobs.is_some();
            let first = a.stopper.output().is_empty();
            let mut ids = Vec::with_capacity(toks.len());
            let (mut text, mut reason) = (String::new(), None);
            for &tok in toks {
                ids.push(tok);
                reason = output::push(&self.tokenizer, a, tok, &mut text);
                if reason.is_some() {
                    break;
                }
            }
            if reason.is_none() {
                reason = output::follow_format(&self.tokenizer, a, &mut ids, &mut text);
            }
            self.metrics.generated(ids.len());
            let logprobs = match out.logprobs.get(k) {
                Some(lp) if wanted => lp[..ids.len().min(lp.len())].to_vec(),
                _ => Vec::new(),
            };
            let prompt_logprobs =
                if first && !a.scores_sent && a.req.params.prompt_logprobs.is_some() {
                    a.scores_sent = true;
                    a.scores.clone()
                } else {
                    Vec::new()
                };
            let ev = GenerateEvent {
                index: a.req.index,
                event: Some(generate_event::Event::Token(TokenEvent {
                    ids,
                    text,
                    logprobs,
                    prompt_logprobs,
                })),
            };
            let _ = a.req.events.send(ev).await;
            if let Some((r, err)) = reason {
                let mut ev = finish(&self.metrics, a, r, err);
                output::tool_calls(&self.tokenizer, a, &mut ev);
                let _ = a.req.events.send(ev).await;
                done_ids.push(id);
                self.free_blocks(a);
            } else {
                self.settle(a);
            }
        }
        active.retain(|a| !done_ids.contains(&a.req.seq_id));
        fl.release.extend(done_ids);
    }
}
