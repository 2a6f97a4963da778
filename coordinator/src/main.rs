//! `coordinator`: the standalone coordinator binary (also `layerstream coordinator`).

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "coordinator",
    version,
    about = "The layerstream coordinator: job API, planner, continuous batching"
)]
struct Cli {
    #[command(flatten)]
    args: layerstream_coordinator::CoordinatorArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Ok(layerstream_coordinator::run(Cli::parse().args).await?)
}
