//! `loader-daemon`: the standalone loader binary (also `layerstream loader-daemon`).

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "loader-daemon",
    version,
    about = "Prefetch layer files into POSIX shared memory for layerstream workers"
)]
struct Cli {
    #[command(flatten)]
    args: layerstream_loader::LoaderArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Ok(layerstream_loader::run(Cli::parse().args).await?)
}
