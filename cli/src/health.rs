//! `layerstream health`: asks a layerstream server (TCP or Unix socket) for its gRPC health; exit
//! status 0 when it is SERVING. For container healthchecks, where no grpcurl is installed.

use anyhow::{bail, Result};
use clap::Args;
use std::path::Path;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{health_check_response::ServingStatus, HealthCheckRequest};

/// Flags of `layerstream health`.
#[derive(Args, Debug)]
pub struct HealthArgs {
    /// `http://host:port` or `unix:/path/to.sock`.
    #[arg(long, env = "LAYERSTREAM_HEALTH_ADDR")]
    pub addr: String,
    /// Service name to ask about ("" = the whole server).
    #[arg(long, env = "LAYERSTREAM_HEALTH_SERVICE", default_value = "")]
    pub service: String,
    /// PEM CA certificate to trust for an `https://` server.
    #[arg(long, env = "LAYERSTREAM_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
}

/// Runs the check.
pub async fn run(a: HealthArgs) -> Result<()> {
    let channel = match a.addr.strip_prefix("unix:") {
        Some(p) => layerstream_rpc::transport::connect_uds(Path::new(p)).await?,
        None => {
            let tls = layerstream_rpc::transport::client_tls(a.tls_ca.as_deref())
                .map_err(|m| anyhow::anyhow!("--tls-ca: {m}"))?;
            layerstream_rpc::transport::endpoint(&a.addr, tls.as_ref())?.connect().await?
        }
    };
    let r = HealthClient::new(channel)
        .check(HealthCheckRequest { service: a.service.clone() })
        .await?
        .into_inner();
    if r.status != ServingStatus::Serving as i32 {
        bail!("{} is not serving (status {})", a.addr, r.status);
    }
    println!("SERVING");
    Ok(())
}
