//! The planner's decisions: layer splits, resident layers, KV capacity and dtype, drafts.
use super::*;
use layerstream_serving::plan::usage;

#[test]
fn split_is_proportional_and_covers_every_layer() {
    let r = split_layers(30, &[1, 1], 0.0).unwrap();
    assert_eq!(r, vec![0..15, 15..30]);
    let r = split_layers(10, &[3 << 30, 1 << 30], 0.0).unwrap();
    assert_eq!(r.iter().map(|x| x.len()).sum::<usize>(), 10);
    assert!(r[0].len() > r[1].len());
    assert_eq!(r[0].end, r[1].start);
    assert!(split_layers(2, &[1, 1, 1], 0.0).unwrap_err().to_string().contains("3 workers"));
    // The head's work counts on the last worker: SmolLM2's 30 layers and 8 layers' worth of
    // head over two equal workers are 19 | 11 + head; a head bigger than everything still
    // leaves every worker a layer.
    assert_eq!(split_layers(30, &[1, 1], 8.1).unwrap(), vec![0..19, 19..30]);
    assert_eq!(split_layers(4, &[1, 1, 1], 40.0).unwrap(), vec![0..2, 2..3, 3..4]);
    let r = split_layers(9, &[1, 1, 1], 3.0).unwrap();
    assert_eq!(r, vec![0..4, 4..8, 8..9]);
}

fn manifest(dir: &std::path::Path) -> Manifest {
    layerstream_model::synth::synth(
        "tiny",
        layerstream_model::DType::Q8_0,
        Some(8),
        3,
        &dir.join("s"),
    )
    .unwrap()
}

#[test]
fn draft_bytes_count_files_and_kv_and_saturate_on_crafted_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = manifest(dir.path());
    let files: u64 = m.files.iter().map(|f| f.size).sum();
    let c = &m.config;
    let kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 16;
    assert_eq!(draft_bytes(&m, 16), files + kv as u64);
    m.config.head_dim = usize::MAX / 2;
    assert_eq!(draft_bytes(&m, 1 << 20), u64::MAX);
}

/// Worker "a" with f32 KV that copies streamed layers into buffers of its own (a GPU's way).
fn copying_worker(budget: u64) -> WorkerSpec {
    WorkerSpec {
        address: "a".into(),
        budget,
        kv_dtype: "f32".into(),
        in_place: false,
        kv_auto: false,
    }
}

fn streaming_plan(r: std::ops::Range<u32>) -> Assignment {
    Assignment {
        layer_start: r.start,
        layer_end: r.end,
        group_size: 1,
        streaming_buffers: 2,
        kv_capacity: 64,
        embed: true,
        head: true,
        prefetch: true,
        ..Default::default()
    }
}

fn opts(resident: Option<usize>) -> PlanOptions {
    PlanOptions {
        resident_layers: resident,
        expert_cache: None,
        group_size: 1,
        buffers: 2,
        kv_capacity: 64,
        prefetch: true,
        draft: None,
        kv_block: 16,
        kv_host_blocks: 0,
    }
}

/// A draft model goes whole to the head worker: its bytes count there (fewer layers stay
/// resident), and one that does not fit is refused naming the worker.
#[test]
fn a_draft_model_is_placed_on_the_head_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path());
    let ws =
        |b: u64| vec![copying_worker(b), WorkerSpec { address: "b".into(), ..copying_worker(b) }];
    let big = 1 << 40;
    let plain = plan(&m, &ws(big), &opts(None)).unwrap();
    let with = PlanOptions { draft: Some(("/d".into(), 12345)), ..opts(None) };
    let p = plan(&m, &ws(big), &with).unwrap();
    assert_eq!((p[0].draft_model.as_str(), p[1].draft_model.as_str()), ("", "/d"));
    assert_eq!(p[1].bytes_needed, plain[1].bytes_needed + 12345);
    assert_eq!(p[0].bytes_needed, plain[0].bytes_needed);
    let huge = PlanOptions { draft: Some(("/d".into(), big + 1)), ..opts(None) };
    let e = plan(&m, &ws(big), &huge).unwrap_err().to_string();
    assert!(e.contains("worker b: the draft model needs"), "{e}");
}

#[test]
fn residency_grows_with_the_budget_and_always_fits() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path());
    let layer = layer_bytes(&m, 0);
    let mut last = 0;
    for extra_layers in [0u64, 2, 5, 20] {
        let budget = usage(&m, &streaming_plan(0..4)).total() + extra_layers * layer;
        let w =
            [copying_worker(budget), WorkerSpec { address: "b".into(), ..copying_worker(budget) }];
        let plans = plan(&m, &w, &opts(None)).unwrap();
        assert_eq!(plans.iter().map(|p| (p.layer_end - p.layer_start) as usize).sum::<usize>(), 8);
        assert!(plans[0].embed && !plans[0].head && plans[1].head && !plans[1].embed);
        for p in &plans {
            assert!(usage(&m, p).total() <= budget);
            assert_eq!(p.bytes_needed, usage(&m, p).total(), "the assignment carries its own size");
        }
        let k = plans[0].resident.len();
        assert!(k >= last, "more budget, no fewer resident layers");
        last = k;
    }
    assert_eq!(last, 4, "a large budget keeps the whole range resident");
}

/// A mixture-of-experts store: a budget that holds everything keeps every expert (cache 0); a
/// smaller one keeps the attention and routers resident first and gives the experts what is
/// left (at least one layer's worth), growing with the budget; every plan fits.
#[test]
fn experts_get_what_the_resident_layers_leave() {
    let dir = tempfile::tempdir().unwrap();
    let m = layerstream_model::synth::synth(
        "tiny-moe",
        layerstream_model::DType::Q8_0,
        Some(4),
        3,
        &dir.path().join("moe"),
    )
    .unwrap();
    let one = |budget: u64| plan(&m, &[copying_worker(budget)], &opts(None)).unwrap().remove(0);
    let full = usage(&m, &Assignment { resident: vec![0, 1, 2, 3], ..streaming_plan(0..4) });
    let everything = full.total() + full.embed_head; // embed + head counted by the real plan
    assert_eq!(one(everything * 2).expert_cache, 0, "everything fits: every expert kept");
    let expert = m.max_expert_bytes();
    let mut last = 0;
    for spare in [0u64, 3, 10] {
        let all_layers = Assignment {
            resident: vec![0, 1, 2, 3],
            expert_cache: 8,
            embed: true,
            head: true,
            ..streaming_plan(0..4)
        };
        let budget = usage(&m, &all_layers).total() + spare * expert;
        let p = one(budget);
        assert_eq!(p.resident, vec![0, 1, 2, 3], "attention and routers resident first");
        assert_eq!(p.expert_cache as u64, 8 + spare, "budget {budget}");
        assert!(usage(&m, &p).total() <= budget && p.expert_cache > last);
        last = p.expert_cache;
    }
    let forced = PlanOptions { expert_cache: Some(3), ..opts(None) };
    let p = plan(&m, &[copying_worker(1 << 40)], &forced).unwrap();
    assert_eq!(p[0].expert_cache, 3, "the flag wins");
}

#[test]
fn budgets_that_cannot_fit_are_errors_naming_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path());
    let w = [WorkerSpec {
        address: "http://w0".into(),
        budget: 1000,
        kv_dtype: "f32".into(),
        in_place: false,
        kv_auto: false,
    }];
    let e = plan(&m, &w, &opts(None)).unwrap_err().to_string();
    assert!(e.contains("http://w0") && e.contains("cannot hold"), "{e}");
    let big = [WorkerSpec {
        address: "http://w0".into(),
        budget: 1 << 40,
        kv_dtype: "f32".into(),
        in_place: false,
        kv_auto: false,
    }];
    assert_eq!(plan(&m, &big, &opts(Some(3))).unwrap()[0].resident, vec![0, 2, 5]);
    let tight = usage(&m, &streaming_plan(0..8)).total();
    let e = plan(
        &m,
        &[WorkerSpec {
            address: "http://w0".into(),
            budget: tight,
            kv_dtype: "f32".into(),
            in_place: false,
            kv_auto: false,
        }],
        &opts(Some(8)),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("8 resident need"), "{e}");
}

#[test]
fn interleave_spreads_resident_layers_starting_with_the_first() {
    assert_eq!(interleave(&(0..10), 4), vec![0, 2, 5, 7]);
    assert_eq!(interleave(&(10..15), 0), Vec::<u32>::new());
    assert_eq!(interleave(&(10..15), 9), vec![10, 11, 12, 13, 14]);
    // every streamed layer has a resident layer before it in its range
    let r = interleave(&(0..12), 3);
    for l in 0..12u32 {
        assert!(r.iter().any(|&x| x <= l));
    }
}

/// Without `--kv-capacity` the capacity is the largest (context, at most 8192, halved) whose
/// plan the budget holds — every layer resident, or past memory a streaming plan with the cache
/// at most an eighth of the budget; a roomy budget keeps the context; a given flag is kept.
#[test]
fn the_kv_capacity_shrinks_to_what_the_budget_holds() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path());
    let w = |budget| [copying_worker(budget)];
    let context = m.config.max_position_embeddings.min(DEFAULT_KV_CAPACITY);
    assert!(context > 512, "the tiny model's context: {context}");
    assert_eq!(kv_capacity_that_fits(&m, &w(1 << 40), &opts(None), None), context);
    assert_eq!(kv_capacity_that_fits(&m, &w(1), &opts(None), Some(333)), 333);
    let needs = |c, resident| {
        let o = PlanOptions { kv_capacity: c, ..opts(resident) };
        plan(&m, &w(1 << 40), &o).unwrap()[0].bytes_needed
    };
    // A budget that keeps every layer resident with 512 positions but not with the context.
    let c = kv_capacity_that_fits(&m, &w(needs(512, None)), &opts(None), None);
    assert!((512..context).contains(&c), "{c}");
    let p = plan(&m, &w(needs(512, None)), &PlanOptions { kv_capacity: c, ..opts(None) });
    assert_eq!(p.unwrap()[0].resident.len(), 8, "every layer stays resident");
    // From a budget that barely streams to one that keeps everything: the plan fits, and a
    // worker past memory gives its cache at most an eighth of the budget. (Layers made large
    // beside the tiny model's cache, as an 8B model's are: the planner reads their sizes.)
    let mut m = m.clone();
    for f in m.files.iter_mut().filter(|f| f.name.starts_with("layer")) {
        f.size *= 1000;
    }
    let needs = |c, resident| {
        let o = PlanOptions { kv_capacity: c, ..opts(resident) };
        plan(&m, &w(1 << 40), &o).unwrap()[0].bytes_needed
    };
    let (low, high) = (needs(MIN_KV_CAPACITY, Some(0)), needs(context, None));
    let mut capped = 0;
    for i in 0..=40 {
        let budget = low + (high - low) / 40 * i;
        let c = kv_capacity_that_fits(&m, &w(budget), &opts(None), None);
        let p = &plan(&m, &w(budget), &PlanOptions { kv_capacity: c, ..opts(None) }).unwrap()[0];
        let kv = usage(&m, p).kv;
        if p.resident.len() < 8 && c > MIN_KV_CAPACITY {
            assert!(kv <= budget / PAST_MEMORY_KV_SHARE, "{budget}: {c} positions, {kv} bytes");
            capped += 1;
        }
    }
    assert!(capped > 0, "some budget streams with more than the fewest positions");
    assert_eq!(kv_capacity_that_fits(&m, &w(1), &opts(None), None), MIN_KV_CAPACITY);
}

/// `--kv-dtype auto` halves a CPU worker's cache past memory, and only then, and only where it
/// came from `auto` (not a given dtype, not under `--exact`).
#[test]
fn auto_kv_dtype_is_f16_past_memory_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path());
    let kv = crate::KvFlags { kv_dtype: "auto".into(), kv_block: 16 };
    let spec = |budget, exact| WorkerSpec::new("a".into(), budget, "cpu", exact, &kv);
    let resident = |budget| plan(&m, &[spec(budget, false)], &opts(None)).unwrap();
    let roomy = resident(1 << 40)[0].bytes_needed;
    let dtypes = |budget, exact| {
        let mut w = [spec(budget, exact)];
        auto_kv_dtypes(&m, &mut w, &opts(None));
        w[0].kv_dtype.clone()
    };
    assert_eq!(dtypes(roomy * 2, false), "f32");
    assert_eq!(dtypes(roomy / 2, false), "f16");
    assert_eq!(dtypes(roomy / 2, true), "f32", "--exact keeps f32");
    let gpu = WorkerSpec::new("g".into(), roomy / 2, "cuda:0", false, &kv);
    assert_eq!((gpu.kv_dtype.as_str(), gpu.kv_auto), ("f16", false));
    let given = crate::KvFlags { kv_dtype: "f32".into(), kv_block: 16 };
    assert!(!WorkerSpec::new("a".into(), 1, "cpu", false, &given).kv_auto);
}

/// A CPU worker computes streamed layers in the loader's slots: its plan does not count
/// streaming buffers, so a budget that holds everything else is enough there and not on a GPU.
#[test]
fn in_place_workers_need_no_streaming_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path());
    let gpu = |budget| [copying_worker(budget)];
    let full = plan(&m, &gpu(1 << 40), &opts(Some(0))).unwrap()[0].bytes_needed;
    let first = &plan(&m, &gpu(1 << 40), &opts(Some(0))).unwrap()[0];
    let buffers = usage(&m, first).streaming;
    assert!(buffers > 0);
    let tight = full - buffers;
    assert!(plan(&m, &gpu(tight), &opts(Some(0))).is_err());
    let cpu = [WorkerSpec { in_place: true, ..gpu(tight)[0].clone() }];
    let p = plan(&m, &cpu, &opts(Some(0))).unwrap();
    assert_eq!(p[0].bytes_needed, tight);
}
