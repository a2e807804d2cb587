//! The subcommands: argument handling around the library modules.

use crate::arch::{family_for, CausalLm, Family, LoadOptions, StateLayout};
use crate::checkpoint::Checkpoint;
use crate::cli::{EvalArgs, InspectArgs, MemoryArgs, ModelArgs};
use crate::data::{windows, TextSource, TextTokenizer};
use anyhow::{Context, Result};
use std::time::Instant;

/// A model opened for a command.
pub struct Loaded {
    pub ckpt: Checkpoint,
    pub family: &'static dyn Family,
    pub layout: StateLayout,
    pub model: Box<dyn CausalLm>,
    pub tokenizer: TextTokenizer,
    /// Whether the model runs layer-streamed.
    pub streamed: bool,
}

/// Resolve, validate and load a model (weights last, after every cheap check passed).
pub fn load(args: &ModelArgs, grad: bool, quiet: bool) -> Result<Loaded> {
    load_with(args, &MemoryArgs::default(), grad, quiet)
}

/// [`load`], layer-streamed when `memory` asks for it or the weights do not fit the device.
pub fn load_with(args: &ModelArgs, memory: &MemoryArgs, grad: bool, quiet: bool) -> Result<Loaded> {
    let dir = crate::hub::resolve_model(&args.model, &args.revision)?;
    let ckpt = Checkpoint::open(&dir)?;
    let family = family_for(&ckpt)?;
    let layout = family.layout(&ckpt)?;
    load_opened(ckpt, family, layout, args, memory, grad, quiet)
}

/// [`load_with`] for a checkpoint already opened and checked (its family and layout).
pub fn load_opened(
    ckpt: Checkpoint,
    family: &'static dyn Family,
    layout: StateLayout,
    args: &ModelArgs,
    memory: &MemoryArgs,
    grad: bool,
    quiet: bool,
) -> Result<Loaded> {
    let start = Instant::now();
    let device = args.device.open()?;
    let dtype = args.dtype.resolve(&device);
    let warm = crate::ops::warm_up::WarmUp::start(&device, dtype);
    let tokenizer = TextTokenizer::load(&ckpt.dir, args.tokenizer.as_deref(), &ckpt.config)?;
    let (model, streamed) = open_model(&ckpt, family, &LoadOptions { dtype, device, grad }, memory)?;
    warm.finish();
    if !quiet {
        let how = if streamed { ", layer-streamed" } else { "" };
        eprintln!("loaded {} ({}{how}) in {:.2?}", args.model, layout.family, start.elapsed());
    }
    Ok(Loaded { ckpt, family, layout, model, tokenizer, streamed })
}

/// The model of `ckpt`, resident or layer-streamed (see `crate::stream::decide`), and which.
pub fn open_model(
    ckpt: &Checkpoint,
    family: &dyn Family,
    opts: &LoadOptions,
    memory: &MemoryArgs,
) -> Result<(Box<dyn CausalLm>, bool)> {
    let what = || format!("loading {} from {}", ckpt.model_type().unwrap_or_default(), ckpt.dir.display());
    let weights = ckpt.streaming_var_builder(opts.dtype, &opts.device)?;
    let layers = family.layers(ckpt, opts, weights).with_context(what)?;
    let sizes = crate::stream::StageSizes::of(ckpt, layers.as_ref(), opts.dtype);
    if crate::stream::decide(&memory.request(), &sizes, &opts.device, opts.dtype, opts.grad)? {
        return Ok((Box::new(crate::arch::layered::Streamed::new(layers)), true));
    }
    let model = family.load(ckpt, opts).with_context(what)?;
    crate::stream::note_device_memory(&opts.device);
    Ok((model, false))
}

/// Tokenized calibration sequences: documents joined with the end-of-text token and cut into
/// `n` sequences of `seqlen` tokens, warning when the text falls short.
pub fn sequences(tok: &TextTokenizer, src: &TextSource, n: usize, seqlen: usize, quiet: bool) -> Result<Vec<Vec<u32>>> {
    if n == 0 || seqlen == 0 {
        anyhow::bail!("the number of sequences and their length must be positive (--nsamples, --seqlen)");
    }
    let want = n * seqlen;
    let mut docs = 0usize;
    let counted = src.documents()?.inspect(|_| docs += 1);
    let stream = tok.stream(counted, want)?;
    let seqs: Vec<Vec<u32>> = stream.chunks_exact(seqlen).take(n).map(<[u32]>::to_vec).collect();
    if seqs.is_empty() {
        anyhow::bail!(
            "the text has {} tokens, fewer than one sequence of {seqlen}; use more text or a smaller --seqlen",
            stream.len()
        );
    }
    if !quiet {
        if seqs.len() < n {
            eprintln!(
                "warning: the text covers {} sequences of {seqlen} tokens, fewer than the {n} asked for",
                seqs.len()
            );
        }
        if docs > 0 && stream.len() / docs < seqlen {
            eprintln!(
                "warning: documents average {} tokens, shorter than --seqlen {seqlen}; they are joined with the end-of-text token",
                stream.len() / docs
            );
        }
    }
    Ok(seqs)
}

pub fn eval(args: &EvalArgs, quiet: bool) -> Result<()> {
    let quiet = quiet || args.json;
    if args.limit.is_some() && args.task != "lambada" {
        anyhow::bail!("--limit counts lambada documents; for --task {} use --windows (ppl) or --samples", args.task);
    }
    match args.task.as_str() {
        "ppl" => {}
        "lambada" => return lambada(args, quiet),
        _ => return recall(args, quiet),
    }
    let src = TextSource::parse(args.data.as_deref(), &args.text_column)?;
    let m = load_with(&args.model, &args.memory, false, quiet)?;
    let tokens = m.tokenizer.stream(src.documents()?, args.windows * args.seqlen + 1)?;
    let wins = windows(&tokens, args.seqlen, args.windows);
    let r = crate::eval::perplexity(m.model.as_ref(), &wins, args.batch_size, quiet)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "ppl {:.4} over {} windows x {} tokens ({} tokens, {:.1} tokens/s)",
            r.ppl, r.windows, r.seqlen, r.tokens, r.tokens_per_second
        );
    }
    Ok(())
}

/// `eval --task lambada`: the documents are read and split before the model loads, so that a
/// file with nothing to score fails at once.
fn lambada(args: &EvalArgs, quiet: bool) -> Result<()> {
    let Some(data) = args.data.as_deref() else {
        anyhow::bail!(
            "--task lambada needs --data FILE: LAMBADA passages, e.g. a .jsonl with one {{\"text\": ...}} per line"
        );
    };
    let src = TextSource::parse(Some(data), &args.text_column)?;
    let texts: Vec<String> = src.documents()?.take(args.limit.unwrap_or(usize::MAX)).collect::<Result<_>>()?;
    if !texts.iter().any(|t| crate::lambada::split(t).is_some()) {
        anyhow::bail!(
            "{data}: none of its {} documents has a last word to predict (text, a space, then the word); \
             pass LAMBADA-style passages and name their field with --text-column (now \"{}\")",
            texts.len(),
            args.text_column
        );
    }
    let m = load_with(&args.model, &args.memory, false, quiet)?;
    let set = crate::lambada::prepare(&m.tokenizer, &texts, args.seqlen)?;
    if set.docs.is_empty() {
        anyhow::bail!("{data}: no document's last word fits in --seqlen {} tokens; raise --seqlen", args.seqlen);
    }
    let r = crate::lambada::evaluate(m.model.as_ref(), &set, args.batch_size, m.tokenizer.eos, quiet)?;
    if !quiet {
        lambada_warnings(&r, texts.len(), args.seqlen);
    }
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "lambada accuracy {:.4} ({} / {}), ppl {:.4} ({} target tokens, {:.1} s)",
        r.accuracy, r.correct, r.total, r.ppl, r.target_tokens, r.seconds
    );
    Ok(())
}

fn lambada_warnings(r: &crate::lambada::LambadaResult, read: usize, seqlen: usize) {
    if r.skipped > 0 {
        eprintln!(
            "warning: skipped {} of {read} documents with no last word to predict (no space after some text)",
            r.skipped
        );
    }
    if r.long_target > 0 {
        eprintln!(
            "warning: skipped {} documents whose last word is longer than --seqlen {seqlen} tokens",
            r.long_target
        );
    }
    if r.truncated > 0 {
        eprintln!(
            "warning: {} documents are longer than --seqlen {seqlen} tokens; their context was cut from the left",
            r.truncated
        );
    }
}

/// `eval --task mqar|passkey`.
fn recall(args: &EvalArgs, quiet: bool) -> Result<()> {
    let task: crate::recall::Task =
        args.task.parse().map_err(|e| anyhow::anyhow!("--task: {e:#} (or ppl, lambada)"))?;
    let dir = crate::hub::resolve_model(&args.model.model, &args.model.revision)?;
    let config = Checkpoint::open(&dir)?.config;
    let vocab = crate::recall::vocab_size(&config).context("config.json has no vocab_size")?;
    crate::recall::check(&[task], &args.recall, &config, vocab)?;
    let m = load(&args.model, false, quiet)?;
    let r = crate::recall::run(task, &args.recall, m.model.as_ref(), &m.tokenizer, vocab, quiet)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!("{} accuracy {:.4} ({} / {}, {:.1} s)", task.name(), r.accuracy, r.correct, r.total, r.seconds);
    for b in &r.buckets {
        println!("  {:<24} {:.4} ({} / {})", b.name, b.accuracy, b.correct, b.total);
    }
    Ok(())
}

pub fn inspect(args: &InspectArgs, quiet: bool) -> Result<()> {
    let quiet = quiet || args.json;
    let src = TextSource::parse(args.data.as_deref(), &args.text_column)?;
    if let Some(plot) = &args.plot {
        let dir = crate::hub::resolve_model(&args.model.model, &args.model.revision)?;
        crate::guard::check_output("--plot", plot, &dir, &Checkpoint::open(&dir)?.files)?;
    }
    let m = load_with(&args.model, &args.memory, false, quiet)?;
    let seqs = sequences(&m.tokenizer, &src, args.nsamples, args.seqlen, quiet)?;
    let mut r = crate::inspect::inspect(m.model.as_ref(), &m.layout, &seqs, args.rows, args.seed, quiet)?;
    r.model = args.model.model.clone();
    if let Some(dir) = &args.plot {
        write_plots(dir, &r)?;
        if !quiet {
            eprintln!("wrote {} spectrum plots to {}", 2 * r.layers.len(), dir.display());
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", crate::inspect::render_table(&r));
    }
    Ok(())
}

fn write_plots(dir: &std::path::Path, r: &crate::inspect::InspectReport) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (layer, spectra) in &r.state_spectra {
        let series: Vec<(String, Vec<f64>)> =
            spectra.iter().enumerate().map(|(h, s)| (format!("head {h}"), s.clone())).collect();
        let svg =
            crate::plot::spectrum_svg(&format!("layer {layer}: final state spectrum"), "sigma_i / sigma_1", &series);
        std::fs::write(dir.join(format!("state_layer{layer:02}.svg")), svg)?;
    }
    for (layer, spectra) in &r.activation_spectra {
        let series: Vec<(String, Vec<f64>)> =
            spectra.iter().enumerate().map(|(h, s)| (format!("head {h}"), s.clone())).collect();
        let svg =
            crate::plot::spectrum_svg(&format!("layer {layer}: key/query activation spectrum"), "sigma_i", &series);
        std::fs::write(dir.join(format!("activations_layer{layer:02}.svg")), svg)?;
    }
    Ok(())
}

pub fn calibrate(args: &crate::cli::CalibrateArgs, quiet: bool) -> Result<()> {
    use crate::calib::{CalibSettings, Calibration};
    use anyhow::bail;
    let c = crate::recipe::Calib::resolve(&args.calib, &crate::recipe::Recipe::default())?;
    let src = TextSource::parse(c.source.as_deref(), &c.text_column)?;
    let dir = crate::hub::resolve_model(&args.model.model, &args.model.revision)?;
    let ckpt = Checkpoint::open(&dir)?;
    let out = &args.output;
    let partial = out.with_extension("partial.safetensors");
    crate::guard::check_output("-o", out, &dir, &ckpt.files)?;
    // Never replaced, with or without --resume, which continues only the partial file.
    if out.is_dir() {
        bail!("{} is a directory; -o names the activations file to write", out.display());
    }
    if out.exists() {
        let complete = args.resume && Calibration::is_activations(out);
        bail!(
            "{} already exists{}; remove it or choose another -o",
            out.display(),
            if complete { " (a complete activations file: --resume continues only its partial file)" } else { "" }
        );
    }
    if partial.is_dir() {
        bail!("{} is a directory; it is where -o {} saves its partial state", partial.display(), out.display());
    }
    let family = family_for(&ckpt)?;
    let layout = family.layout(&ckpt)?;
    let hidden = ckpt.hidden_size()?;
    let settings = CalibSettings {
        nsamples: c.nsamples,
        seqlen: c.seqlen,
        seed: c.seed,
        rows: c.rows,
        grad: args.calib.grad,
        source: c.source.clone().unwrap_or_else(|| "builtin".into()),
    };
    let mut cal = if args.resume && partial.exists() {
        let (cal, complete) = Calibration::load(&partial, &layout)?;
        if complete {
            bail!(
                "{} is marked complete, not a partial calibration; rename it to {} instead of resuming",
                partial.display(),
                out.display()
            );
        }
        cal.check_weights(&partial, &ckpt)?;
        if cal.settings != settings || cal.text_column != c.text_column {
            bail!(
                "{} was started with other settings ({:?}); pass the same flags to resume",
                partial.display(),
                cal.settings
            );
        }
        if !quiet {
            eprintln!("resuming after {} of {} sequences", cal.sequences_done, settings.nsamples);
        }
        cal
    } else {
        if partial.exists() {
            bail!(
                "{} holds an interrupted calibration to {}; pass --resume to continue it, or remove it",
                partial.display(),
                out.display()
            );
        }
        let mut cal = Calibration::new(settings, &layout, hidden);
        cal.text_column = c.text_column.clone();
        cal.fingerprint_weights(&ckpt)?;
        cal
    };
    let m = load_opened(ckpt, family, layout, &args.model, &args.memory, args.calib.grad, quiet)?;
    let seqs = sequences(&m.tokenizer, &src, c.nsamples, c.seqlen, quiet)?;
    // A signal from here on saves the partial state before the run ends (layer-streamed runs
    // save no partial state: a signal ends them at once).
    let resumable = (!m.streamed).then(crate::signals::Resumable::start);
    cal.run(m.model.as_ref(), &seqs, args.calib.batch(), Some((&partial, args.save_every)), quiet)?;
    cal.save(out, true)?;
    if partial.exists() {
        std::fs::remove_file(&partial)?;
    }
    drop(resumable);
    let rows: usize = cal.collector.layers.values().map(|l| l.keys.len() + l.queries.len()).sum();
    println!(
        "calibrated {} sequences ({} tokens): {} key/query rows over {} layers{} -> {}",
        cal.sequences_done,
        cal.tokens,
        rows,
        cal.collector.layers.len(),
        if args.calib.grad { ", gradients" } else { "" },
        out.display()
    );
    Ok(())
}
