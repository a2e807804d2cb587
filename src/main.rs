use clap::Parser;
use statecut::cli::{Cli, Command};

fn main() {
    // Before any thread starts: every later thread inherits the blocked signals.
    statecut::signals::install();
    // Gradients that meet are summed 16 bytes a thread on GPUs (the same bits as candle's add).
    statecut::ops::add::use_for_gradients();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print and exit 0; a usage error is one line and exit 1, as any other.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => fail(&statecut::cli::usage_error(&e)),
    };
    let q = cli.quiet;
    let result = match &cli.command {
        Command::Eval(a) => statecut::commands::eval(a, q),
        Command::Inspect(a) => statecut::commands::inspect(a, q),
        Command::Calibrate(a) => statecut::commands::calibrate(a, q),
        Command::Prune(a) => statecut::prune::run(a, q),
        Command::Bench(a) => statecut::bench::run(a, q),
        Command::Sweep(a) => statecut::sweep::run(a, q),
        Command::Recover(a) => statecut::recover::run(a, q),
    };
    if let Some(table) = statecut::profile::report() {
        eprintln!("{table}");
    }
    if let Err(e) = result {
        // One line: the context chain joined with ": " (candle appends backtraces on later lines).
        fail(&format!("{e:#}"));
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("error: {}", msg.lines().next().unwrap_or("unknown error").trim_end());
    std::process::exit(1);
}
