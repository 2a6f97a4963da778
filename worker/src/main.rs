//! `worker`: the standalone worker binary (also `layerstream worker`).

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "worker",
    version,
    about = "A layerstream worker: one device, a range of layers, their KV caches"
)]
struct Cli {
    #[command(flatten)]
    args: layerstream_worker::WorkerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Ok(layerstream_worker::run(Cli::parse().args).await?)
}
