//! `layerstream otlp-sink`: a minimal OTLP/gRPC trace receiver that appends every span it gets to a
//! JSON-lines file. For tests and for machines where Jaeger cannot run; Jaeger is the real UI.

use anyhow::Result;
use clap::Args;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use tonic::{Request, Response, Status};

/// Flags of `layerstream otlp-sink`.
#[derive(Args, Debug)]
pub struct SinkArgs {
    /// Address to receive OTLP/gRPC on.
    #[arg(long, env = "LAYERSTREAM_OTLP_SINK_LISTEN", default_value = "127.0.0.1:4317")]
    pub listen: String,
    /// JSON-lines file the spans are appended to.
    #[arg(long, env = "LAYERSTREAM_OTLP_SINK_OUT")]
    pub out: PathBuf,
}

struct Sink(Mutex<std::fs::File>);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn value(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> serde_json::Value {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone().into(),
        Some(Value::BoolValue(b)) => (*b).into(),
        Some(Value::IntValue(i)) => (*i).into(),
        Some(Value::DoubleValue(d)) => (*d).into(),
        _ => serde_json::Value::Null,
    }
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        r: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut f = self.0.lock().unwrap();
        for rs in r.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                .map(|a| value(&a.value))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let attrs: serde_json::Map<String, serde_json::Value> =
                        s.attributes.iter().map(|a| (a.key.clone(), value(&a.value))).collect();
                    let links: Vec<serde_json::Value> = s
                        .links
                        .iter()
                        .map(|l| serde_json::json!({"trace_id": hex(&l.trace_id), "span_id": hex(&l.span_id)}))
                        .collect();
                    let line = serde_json::json!({
                        "service": service, "name": s.name, "trace_id": hex(&s.trace_id), "span_id": hex(&s.span_id),
                        "parent_span_id": hex(&s.parent_span_id), "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                        "attributes": attrs, "links": links,
                    });
                    writeln!(f, "{line}")
                        .map_err(|e| layerstream_rpc::Error::Internal(e.to_string()))?;
                }
            }
        }
        f.flush().map_err(|e| layerstream_rpc::Error::Internal(e.to_string()))?;
        Ok(Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// Serves until SIGINT/SIGTERM; prints `LISTENING <addr>` when ready.
pub async fn run(a: SinkArgs) -> Result<()> {
    let file = std::fs::OpenOptions::new().create(true).append(true).open(&a.out)?;
    let listener = tokio::net::TcpListener::bind(&a.listen).await?;
    layerstream_rpc::handshake::Listening::new(format!("http://{}", listener.local_addr()?))
        .announce();
    layerstream_rpc::transport::server()
        .add_service(TraceServiceServer::new(Sink(Mutex::new(file))))
        .serve_with_incoming_shutdown(
            layerstream_rpc::transport::tcp_incoming(listener),
            layerstream_rpc::transport::shutdown_signal(),
        )
        .await?;
    Ok(())
}
