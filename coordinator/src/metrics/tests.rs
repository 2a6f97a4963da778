//! The metrics' exposition, checked line by line.
use super::*;
use layerstream_rpc::v1::{LayerTiming, LoaderStats};

#[test]
fn exposition_names_are_prefixed_and_counts_add_up() {
    let m = Metrics::new();
    m.finished(FinishReason::Length, 7, 3, Some(0.5), 0.9);
    m.generated(3);
    let t = |tr, st| LayerTiming {
        layer: 1,
        resident: false,
        bytes: 100,
        transfer_ms: tr,
        compute_ms: 2.0,
        stall_ms: st,
        experts_needed: 4,
        experts_hit: 1,
        experts_prefetched: 2,
        experts_missed: 1,
    };
    let w0 = crate::pipeline::WorkerStep {
        address: "w0".into(),
        layers: vec![t(4.0, 1.0), t(4.0, 0.0)],
        wall_ms: 9.0,
    };
    m.step(2, 5, 10.0, &[w0]);
    let mut info = InfoResponse {
        loader: Some(LoaderStats {
            namespace: "ns".into(),
            hits: 5,
            misses: 2,
            pinned: 0,
            disk_bytes: 3000,
            disk_seconds: 0.5,
            disk_busy_seconds: 0.25,
        }),
        ..Default::default()
    };
    m.worker_info("w0", Some(&info), true);
    // A second worker on the same loader reports the same counters: not counted twice.
    m.worker_info("w1", Some(&info), false);
    info.loader.as_mut().unwrap().hits = 9;
    m.worker_info("w0", Some(&info), true);
    let text = m.encode();
    let has = |line: &str| assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
    has("layerstream_requests_total{finish_reason=\"length\"} 1");
    has("layerstream_prompt_tokens_total 7");
    has("layerstream_generation_tokens_total 3");
    has("layerstream_worker_bytes_streamed_total{worker=\"w0\"} 200");
    has("layerstream_worker_experts_total{worker=\"w0\",outcome=\"prefetched\"} 4");
    has("layerstream_worker_hidden_transfer_ratio{worker=\"w0\"} 0.875");
    has("layerstream_worker_up{worker=\"w0\"} 1");
    has("layerstream_worker_up{worker=\"w1\"} 0");
    has("layerstream_loader_cache_hits_total{loader=\"ns\"} 9");
    has("layerstream_loader_cache_misses_total{loader=\"ns\"} 2");
    has("layerstream_loader_disk_read_bytes_total{loader=\"ns\"} 3000");
    has("layerstream_loader_disk_read_seconds_total{loader=\"ns\"} 0.5");
    has("layerstream_loader_disk_busy_seconds_total{loader=\"ns\"} 0.25");
    has("layerstream_time_per_output_token_seconds_count 1");
    assert_eq!(m.recent().len(), 1);
    assert!(text.ends_with("# EOF\n"));
}

/// With a prediction, each decode step (one row a sequence) is set beside it and counted; a step
/// with prompt rows is not; without one nothing is.
#[test]
fn decode_steps_are_counted_beside_the_prediction() {
    let curve: crate::cost::Curve = "1:0.010,8:0.024".parse().unwrap();
    let m = Metrics::predicting(Some(curve));
    m.step(4, 4, 20.0, &[]);
    m.step(2, 40, 90.0, &[]);
    m.step(8, 8, 30.0, &[]);
    let p: Vec<Option<f64>> = m.recent().iter().map(|s| s.predicted_ms).collect();
    assert_eq!(p.len(), 3);
    assert!((p[0].unwrap() - 16.0).abs() < 1e-9 && p[1].is_none(), "{p:?}");
    assert!((p[2].unwrap() - 24.0).abs() < 1e-9, "{p:?}");
    let text = m.encode();
    let value = |name: &str| {
        let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{text}"));
        line.rsplit(' ').next().unwrap().parse::<f64>().unwrap()
    };
    assert!((value("layerstream_decode_step_seconds_total") - 0.05).abs() < 1e-9);
    assert!((value("layerstream_decode_step_predicted_seconds_total") - 0.04).abs() < 1e-9);
    let plain = Metrics::new();
    plain.step(4, 4, 20.0, &[]);
    assert_eq!(plain.recent()[0].predicted_ms, None);
    assert!(plain.encode().contains("layerstream_decode_step_predicted_seconds_total 0"));
}
