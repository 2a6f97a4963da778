//! `bench`'s report: the results as two tables, and the cost model's prediction beside each
//! measured configuration.

use crate::bench::{BenchArgs, Row};

/// The results as two markdown tables, each under 120 columns: throughput, then where the time went.
pub(crate) fn tables(rows: &[Row]) -> String {
    let mut t = String::from("| config | tok/s | prefill tok/s | first token ms | decode tok/s | MB/step | GB/s | GB/s over wall |\n");
    t += "|---|---|---|---|---|---|---|---|\n";
    for r in rows {
        t += &format!(
            "| {} | {:.1} | {:.1} | {:.0} | {:.1} | {:.2} | {:.2} | {:.2} |\n",
            r.config,
            r.tokens_per_s,
            r.prefill_tok_s,
            r.first_token_ms,
            r.decode_tok_s,
            r.bytes_streamed_per_step / 1e6,
            r.transfer_gbps,
            r.stream_gbps_wall
        );
    }
    t += "\n| config | pass / Σmax(transfer, compute) | overlap % | outside layers % | transfer ms | stall ms | compute ms |\n";
    t += "|---|---|---|---|---|---|---|\n";
    for r in rows {
        t += &format!(
            "| {} | {:.2} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} |\n",
            r.config,
            r.step_over_ideal,
            r.overlap_pct,
            r.outside_layers_pct,
            r.transfer_ms,
            r.stall_ms,
            r.compute_ms
        );
    }
    t
}

/// Fills each row's `predicted_decode_tok_s` from the cost model (`plan::predict_stack`, the same
/// `up` command line, in a `layerstream plan` process of its own) and prints predicted beside
/// measured; where the loader timed its disk during the run, predicts again at that rate
/// (`predicted_at_run_disk_tok_s`); for a mixture-of-experts store, again with the expert caches
/// missing the share of needs the run measured (`predicted_at_run_experts_tok_s`).
pub(crate) fn predict_rows(rows: &mut [Row], model: &str, a: &BenchArgs, extras: [&[String]; 2]) {
    for (r, extra) in rows.iter_mut().zip(extras) {
        let args = crate::bench::stack_args(model, a, extra);
        let predict = |at: (Option<f64>, Option<f64>)| {
            crate::plan::predict_stack(&args, &[a.batch], at)
                .map(|(p, _)| (p[0].tokens_per_s, p[0].bound.clone()))
        };
        let measured = r.decode_tok_s;
        let said = |tok_s: f64, bound: &str| {
            format!(
                "{tok_s:.2} predicted (measured ÷ predicted {:.2}; bound by {bound})",
                measured / tok_s.max(1e-9)
            )
        };
        match predict((None, None)) {
            Ok((tok_s, bound)) => {
                r.predicted_decode_tok_s = Some(tok_s);
                let s = said(tok_s, &bound);
                println!(
                    "{}: decode {measured:.2} tok/s measured, {s} by plan's cost model",
                    r.config
                );
            }
            Err(e) => println!("{}: no prediction ({e:#})", r.config),
        }
        if let Some(gbps) = r.disk_gbps_run {
            if let Ok((tok_s, bound)) = predict((Some(gbps), None)) {
                r.predicted_at_run_disk_tok_s = Some(tok_s);
                println!(
                    "{}: at the disk rate the loader measured during the run ({gbps:.2} GB/s, reads \
                     overlapped), {}",
                    r.config,
                    said(tok_s, &bound)
                );
            }
        }
        let [needed, _, prefetched, missed] = r.experts;
        if needed == 0 {
            continue;
        }
        let share = (prefetched + missed) as f64 / needed as f64;
        r.expert_misses_run = Some(share);
        if let Ok((tok_s, bound)) = predict((r.disk_gbps_run, Some(share))) {
            r.predicted_at_run_experts_tok_s = Some(tok_s);
            println!(
                "{}: with the expert cache missing {:.1}% of the needs, as in the run{}, {}",
                r.config,
                share * 100.0,
                if r.disk_gbps_run.is_some() { " (and its disk rate)" } else { "" },
                said(tok_s, &bound)
            );
        }
    }
}

/// Counts the streamed run's disk rate where the disk bounded it (`served::record`), after its own
/// prediction was made from the runs before it; says so, or why a record failed.
pub(crate) fn record_served(model: &str, a: &BenchArgs, r: &Row) {
    let Some((buffered, gbps)) = r.disk_bound_run else { return };
    let kept = layerstream_model::Store::open(std::path::Path::new(model))
        .map_err(anyhow::Error::from)
        .and_then(|s| Ok(crate::served::record(&s, &a.device, buffered, gbps)?));
    match kept {
        Ok(()) => println!(
            "{}: the disk bounded this run: its {gbps:.2} GB/s is kept for the next predictions \
             (`layerstream plan`)",
            r.config
        ),
        Err(e) => eprintln!("layerstream bench: the run's disk rate not kept: {e}"),
    }
}

/// The disk's GB/s between two of the loader's descriptions: bytes read ÷ the wall time a read was
/// in flight; None under 64 MB read (a few reads time nothing) or with no busy time.
pub(crate) fn disk_rate(
    before: &layerstream_rpc::v1::DescribeResponse,
    after: &layerstream_rpc::v1::DescribeResponse,
) -> Option<f64> {
    let bytes = after.disk_bytes.checked_sub(before.disk_bytes)?;
    let busy = after.disk_busy_seconds - before.disk_busy_seconds;
    (bytes >= 64 << 20 && busy > 0.0).then(|| bytes as f64 / busy / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The printed tables fit a 120-column terminal even with large figures.
    #[test]
    fn tables_fit_120_columns() {
        let r = Row {
            config: "streamed (prefetch off)".into(),
            tokens: 1,
            wall_s: 1.0,
            tokens_per_s: 12345.6,
            micro_batches: 2,
            workers_busy_pct: 87.5,
            prefill_tok_s: 123456.7,
            first_token_ms: 123456.0,
            decode_tok_s: 12345.6,
            bytes_streamed_per_step: 9.63e9,
            transfer_gbps: 55.12,
            stream_gbps_wall: 54.1,
            step_over_ideal: 1.07,
            outside_layers_pct: 16.8,
            overlap_pct: 92.9,
            transfer_ms: 123456.0,
            compute_ms: 123456.0,
            stall_ms: 12345.0,
            loader_hits: 0,
            loader_misses: 0,
            experts: [0; 4],
            steps: 1,
            predicted_decode_tok_s: None,
            disk_gbps_run: None,
            disk_bound_run: None,
            predicted_at_run_disk_tok_s: None,
            expert_misses_run: None,
            predicted_at_run_experts_tok_s: None,
        };
        let t = tables(&[r.clone(), r]);
        assert!(t.lines().all(|l| l.chars().count() <= 120), "{t}");
        assert_eq!(t.lines().filter(|l| l.starts_with("| streamed")).count(), 4);
    }

    /// The disk's rate over a run: the bytes read between two descriptions over the busy seconds
    /// between them; nothing from a run that read too little to time, or a restarted loader.
    #[test]
    fn disk_rate_is_the_bytes_over_the_busy_time_between_two_descriptions() {
        use layerstream_rpc::v1::DescribeResponse;
        let d = |bytes: u64, busy: f64| DescribeResponse {
            disk_bytes: bytes,
            disk_busy_seconds: busy,
            disk_seconds: 99.0, // each read's own seconds: not the overlapped rate
            ..Default::default()
        };
        let g = disk_rate(&d(1_000_000_000, 2.0), &d(4_000_000_000, 4.0)).unwrap();
        assert!((g - 1.5).abs() < 1e-9, "{g}");
        assert_eq!(disk_rate(&d(0, 0.0), &d(1 << 20, 0.1)), None, "1 MiB: too little");
        assert_eq!(disk_rate(&d(5 << 30, 9.0), &d(1 << 30, 1.0)), None, "restarted loader");
        assert_eq!(disk_rate(&d(0, 1.0), &d(1 << 30, 1.0)), None, "no busy time");
    }
}
