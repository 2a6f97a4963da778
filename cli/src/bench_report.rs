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
/// measured.
pub(crate) fn predict_rows(rows: &mut [Row], model: &str, a: &BenchArgs, extras: [&[String]; 2]) {
    for (r, extra) in rows.iter_mut().zip(extras) {
        let p = crate::plan::predict_stack(&crate::bench::stack_args(model, a, extra), &[a.batch]);
        match p.map(|(p, _)| (p[0].tokens_per_s, p[0].bound.clone())) {
            Ok((tok_s, bound)) => {
                r.predicted_decode_tok_s = Some(tok_s);
                println!(
                    "{}: decode {:.2} tok/s measured, {:.2} predicted by plan's cost model \
                     (measured ÷ predicted {:.2}; bound by {bound})",
                    r.config,
                    r.decode_tok_s,
                    tok_s,
                    r.decode_tok_s / tok_s.max(1e-9),
                );
            }
            Err(e) => println!("{}: no prediction ({e:#})", r.config),
        }
    }
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
        };
        let t = tables(&[r.clone(), r]);
        assert!(t.lines().all(|l| l.chars().count() <= 120), "{t}");
        assert_eq!(t.lines().filter(|l| l.starts_with("| streamed")).count(), 4);
    }
}
