use clap::Parser;
use statecut::cli::{Cli, Command};

fn main() {
    let cli = Cli::parse();
    let q = cli.quiet;
    let result = match &cli.command {
        Command::Eval(a) => statecut::commands::eval(a, q),
        Command::Inspect(a) => statecut::commands::inspect(a, q),
        Command::Calibrate(a) => statecut::commands::calibrate(a, q),
        Command::Prune(a) => statecut::prune::run(a, q),
        Command::Bench(a) => statecut::bench::run(a, q),
        Command::Sweep(a) => statecut::sweep::run(a, q),
    };
    if let Some(table) = statecut::profile::report() {
        eprintln!("{table}");
    }
    if let Err(e) = result {
        // One line: the context chain joined with ": " (candle appends backtraces on later lines).
        let msg = format!("{e:#}");
        eprintln!("error: {}", msg.lines().next().unwrap_or("unknown error").trim_end());
        std::process::exit(1);
    }
}
