//! Tracing for every layerstream process: `tracing` spans exported over OTLP (when an endpoint is
//! given) and W3C trace context carried across gRPC in metadata, so a job is one trace.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Shuts the exporter down (flushing spans) when dropped.
pub struct TracingGuard {
    provider: SdkTracerProvider,
}

impl TracingGuard {
    /// Flushes pending spans now.
    pub fn flush(&self) {
        let _ = self.provider.force_flush();
    }
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// Installs the global subscriber: logs to stderr (`RUST_LOG`, default info) and spans to OTLP gRPC at
/// `otlp_endpoint` when set. Trace ids are generated and propagated even with no endpoint.
/// A missing collector only logs export errors; it never blocks or fails the process.
pub fn init_tracing(otlp_endpoint: Option<&str>, service_name: &str) -> TracingGuard {
    use opentelemetry_otlp::WithExportConfig;
    let resource =
        opentelemetry_sdk::Resource::builder().with_service_name(service_name.to_owned()).build();
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if let Some(ep) = otlp_endpoint.filter(|e| !e.is_empty()) {
        match opentelemetry_otlp::SpanExporter::builder().with_tonic().with_endpoint(ep).build() {
            Ok(exporter) => builder = builder.with_batch_exporter(exporter),
            Err(e) => eprintln!("{service_name}: OTLP exporter for {ep} unavailable: {e}"),
        }
    }
    let provider = builder.build();
    let tracer = provider.tracer(service_name.to_owned());
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,h2=warn,tower=warn,hyper=warn,opentelemetry=warn")
    });
    let _ = tracing_subscriber::registry()
        // Export only layerstream's own spans (not h2/hyper/tonic internals), whatever RUST_LOG says.
        .with(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(
            tracing_subscriber::filter::filter_fn(|m| m.target().starts_with("layerstream")),
        ))
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_target(false)
                .with_filter(filter),
        )
        .try_init();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    TracingGuard { provider }
}

use tracing_subscriber::Layer as _;

struct MetaInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetaInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) =
            (tonic::metadata::MetadataKey::from_bytes(key.as_bytes()), value.parse())
        {
            self.0.insert(k, v);
        }
    }
}

struct MetaExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetaExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Wraps `msg` in a request carrying `span`'s trace context (W3C traceparent).
pub fn traced_request<T>(span: &tracing::Span, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    let cx = span.context();
    TraceContextPropagator::new().inject_context(&cx, &mut MetaInjector(req.metadata_mut()));
    req
}

/// Makes `span` a child of the trace context in a request's metadata, if any.
pub fn adopt_parent(span: &tracing::Span, meta: &tonic::metadata::MetadataMap) {
    let cx = TraceContextPropagator::new().extract(&MetaExtractor(meta));
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// A span's trace context, kept past the span's end, so spans made later or on another thread (a
/// prefetch running ahead of the step that will use it) can join that trace.
#[derive(Clone, Default)]
pub struct TraceParent(opentelemetry::Context);

impl TraceParent {
    /// The trace context of `span`.
    pub fn of(span: &tracing::Span) -> TraceParent {
        TraceParent(span.context())
    }

    /// Makes `span` (new, without children yet) a child of this context, if it is a valid one.
    pub fn adopt(&self, span: &tracing::Span) {
        if self.0.span().span_context().is_valid() {
            let _ = span.set_parent(self.0.clone());
        }
    }
}

/// Links `from` to `to` (an OpenTelemetry span link; Jaeger shows it as a reference): a request's
/// step span points at the one step span whose trace holds the workers' spans of the batch it rode.
pub fn link(from: &tracing::Span, to: &tracing::Span) {
    let sc = to.context().span().span_context().clone();
    if sc.is_valid() {
        from.add_link(sc);
    }
}

/// The hex trace id of `span` (empty if it has none).
pub fn trace_id(span: &tracing::Span) -> String {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    if sc.is_valid() {
        sc.trace_id().to_string()
    } else {
        String::new()
    }
}
