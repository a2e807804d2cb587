//! LAMBADA last-word prediction, scored as lm-eval-harness's `lambada_openai` task scores it
//! (its task yaml, `TemplateLM._encode_pair` and `HFLM._loglikelihood_tokens`, as of 0.4.13).
//!
//! - Split (`doc_to_text` / `doc_to_target`): the context is the text before its last space
//!   (U+0020 only: `text.split(' ')[:-1]|join(' ')`) and the target is that space and the rest
//!   (`' ' + text.split(' ')[-1]`), so a trailing newline stays in the target and a text ending in
//!   a space has the target `" "`. Whitespace at the end of the context then moves to the start of
//!   the target, as lm-eval's `_encode_pair` does: `"a  b"` is `"a"` + `"  b"`.
//! - Tokens (`_encode_pair`, causal models): the whole text and the context are encoded with the
//!   tokenizer's default special tokens (transformers' `add_special_tokens=True`); the target
//!   tokens are the whole text's tokens after the context's count.
//! - Window (`_loglikelihood_tokens`): the model reads the last `seqlen + 1` tokens minus the
//!   final one, so a long context is cut from the left and at most `seqlen` tokens are read.
//! - Scores: `loglik` = sum of log p(target token) over the target tokens; `is_greedy` = the
//!   arg-max at every target position is the target token. Accuracy is the mean of `is_greedy`,
//!   perplexity is `exp(-mean loglik)` over documents (the `perplexity` aggregation).
//!
//! Unlike lm-eval, documents with no space, or nothing before the last space, are skipped (lm-eval
//! would score them after its BOS/EOS prefix token), and so are targets longer than `seqlen`
//! tokens (lm-eval asserts they fit). Batches are right-padded: a causal model's logits at a position do
//! not depend on the tokens after it.

use crate::arch::{CausalLm, NoObserver};
use crate::data::TextTokenizer;
use anyhow::Result;
use candle_core::{DType, Tensor, D};
use serde::Serialize;
use std::time::Instant;

/// `(context, target)` of a document: `context + target == text`. `None` when the text has no
/// space, or nothing but whitespace before its last one.
pub fn split(text: &str) -> Option<(&str, &str)> {
    let last = text.rfind(' ')?;
    // Python's `str.rstrip()`, which lm-eval applies: Unicode whitespace and \x1c-\x1f.
    let at = text[..last].trim_end_matches(|c: char| c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)).len();
    (at > 0).then(|| text.split_at(at))
}

/// One scored document: the tokens the model reads and the target tokens it must predict after
/// them (the last `targets.len()` of `input` shifted by one).
#[derive(Debug, Clone, PartialEq)]
pub struct Doc {
    pub input: Vec<u32>,
    pub targets: Vec<u32>,
    /// Whether the context was cut from the left to fit `seqlen`.
    pub truncated: bool,
}

/// Why a split document could not be scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unscored {
    /// The target encodes to no token of its own, or the context to none.
    NoTarget,
    /// The target alone is longer than `seqlen` tokens.
    LongTarget,
}

/// Tokens of the split document `(context, target)`, keeping at most `seqlen` input tokens.
pub fn tokenize(tok: &TextTokenizer, context: &str, target: &str, seqlen: usize) -> Result<Result<Doc, Unscored>> {
    let whole = tok.encode_special(&format!("{context}{target}"))?;
    let n_ctx = tok.encode_special(context)?.len();
    Ok(doc(whole, n_ctx, seqlen))
}

/// A [`Doc`] from the whole text's tokens, of which the first `n_ctx` are the context's.
fn doc(whole: Vec<u32>, n_ctx: usize, seqlen: usize) -> Result<Doc, Unscored> {
    let n_target = whole.len().saturating_sub(n_ctx);
    // The context must keep at least one token for the first target token to be predicted from.
    if n_target == 0 || n_target >= whole.len() {
        return Err(Unscored::NoTarget);
    }
    if n_target > seqlen {
        return Err(Unscored::LongTarget);
    }
    let keep = whole.len().min(seqlen + 1);
    let window = &whole[whole.len() - keep..];
    Ok(Doc {
        input: window[..keep - 1].to_vec(),
        targets: whole[whole.len() - n_target..].to_vec(),
        truncated: keep < whole.len(),
    })
}

/// The scored documents of a text and the counts of those left out.
#[derive(Debug, Clone, Default)]
pub struct Prepared {
    pub docs: Vec<Doc>,
    /// Documents with no last word to predict (see [`split`]) or whose target has no token.
    pub skipped: usize,
    /// Documents whose target alone is longer than `seqlen` tokens.
    pub long_target: usize,
}

/// Split and tokenize `texts`, keeping at most `seqlen` input tokens per document.
pub fn prepare(tok: &TextTokenizer, texts: &[String], seqlen: usize) -> Result<Prepared> {
    let mut p = Prepared::default();
    for text in texts {
        let Some((context, target)) = split(text) else {
            p.skipped += 1;
            continue;
        };
        match tokenize(tok, context, target, seqlen)? {
            Ok(d) => p.docs.push(d),
            Err(Unscored::NoTarget) => p.skipped += 1,
            Err(Unscored::LongTarget) => p.long_target += 1,
        }
    }
    Ok(p)
}

/// What `lambada` measured.
#[derive(Debug, Clone, Serialize)]
pub struct LambadaResult {
    pub task: &'static str,
    /// Documents whose last word is the arg-max prediction at every target token, over `total`.
    pub accuracy: f64,
    pub correct: usize,
    /// Documents scored.
    pub total: usize,
    /// exp(-loglik / total).
    pub ppl: f64,
    /// Sum over documents of the target's log-likelihood (nats).
    pub loglik: f64,
    /// Target tokens over all documents.
    pub target_tokens: usize,
    /// Documents whose context was cut from the left to fit `seqlen`.
    pub truncated: usize,
    /// Documents left out: no last word to predict, or a target longer than `seqlen` tokens.
    pub skipped: usize,
    pub long_target: usize,
    /// The most tokens the model read for one document.
    pub longest_input: usize,
    pub seconds: f64,
}

/// (log-likelihood, is_greedy) of each document of a batch from its logits [B, L, V].
fn score(logits: &Tensor, docs: &[&Doc]) -> Result<Vec<(f64, bool)>> {
    let mut out = Vec::with_capacity(docs.len());
    for (b, d) in docs.iter().enumerate() {
        let n = d.targets.len();
        let rows = logits.get(b)?.narrow(0, d.input.len() - n, n)?.to_dtype(DType::F32)?;
        let targets = Tensor::new(d.targets.as_slice(), rows.device())?.unsqueeze(1)?;
        let picked = candle_nn::ops::log_softmax(&rows, D::Minus1)?.gather(&targets, 1)?;
        let ll = picked.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| *x as f64).sum();
        let greedy = rows.argmax(D::Minus1)?.to_vec1::<u32>()? == d.targets;
        out.push((ll, greedy));
    }
    Ok(out)
}

/// The inputs of `docs` right-padded (with `pad`) to the longest of each batch of `batch`.
fn padded(docs: &[&Doc], batch: usize, pad: u32) -> Vec<Vec<u32>> {
    let mut out = Vec::with_capacity(docs.len());
    for chunk in docs.chunks(batch) {
        let len = chunk.iter().map(|d| d.input.len()).max().unwrap_or(0);
        out.extend(chunk.iter().map(|d| {
            let mut v = d.input.clone();
            v.resize(len, pad);
            v
        }));
    }
    out
}

/// Score `docs` on `model`, `batch` documents per forward (longest first, as lm-eval orders them,
/// so that batches pad little and the largest comes first).
pub fn evaluate(model: &dyn CausalLm, set: &Prepared, batch: usize, pad: u32, quiet: bool) -> Result<LambadaResult> {
    let docs = &set.docs;
    anyhow::ensure!(!docs.is_empty(), "no document to score");
    let start = Instant::now();
    let mut order: Vec<&Doc> = docs.iter().collect();
    order.sort_by_key(|d| std::cmp::Reverse(d.input.len()));
    let batch = batch.max(1);
    let inputs = padded(&order, batch, pad);
    let mut scores = Vec::with_capacity(order.len());
    if let Some(layers) = model.layers() {
        let seqs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
        let on_logits = |first: usize, logits: &Tensor| -> Result<()> {
            scores.extend(score(logits, &order[first..first + logits.dim(0)?])?);
            Ok(())
        };
        let pb = crate::stream::layer_bar(layers, "lambada", quiet);
        crate::stream::run_layer_major(layers, &seqs, 0, Some(batch), &mut NoObserver, on_logits, pb)?;
    } else {
        let pb = crate::progress::bar(order.len() as u64, "lambada", quiet);
        for (docs, ins) in order.chunks(batch).zip(inputs.chunks(batch)) {
            let flat: Vec<u32> = ins.iter().flatten().copied().collect();
            let ids = Tensor::from_vec(flat, (ins.len(), ins[0].len()), model.device())?;
            scores.extend(score(&model.forward(&ids, &mut NoObserver)?, docs)?);
            pb.inc(docs.len() as u64);
            let correct = scores.iter().filter(|s| s.1).count();
            pb.set_message(format!("acc {:.3}", correct as f64 / scores.len() as f64));
        }
        pb.finish_and_clear();
    }
    let total = scores.len();
    let correct = scores.iter().filter(|s| s.1).count();
    let loglik: f64 = scores.iter().map(|s| s.0).sum();
    Ok(LambadaResult {
        task: "lambada",
        accuracy: correct as f64 / total as f64,
        correct,
        total,
        ppl: (-loglik / total as f64).exp(),
        loglik,
        target_tokens: docs.iter().map(|d| d.targets.len()).sum(),
        truncated: docs.iter().filter(|d| d.truncated).count(),
        skipped: set.skipped,
        long_target: set.long_target,
        longest_input: docs.iter().map(|d| d.input.len()).max().unwrap_or(0),
        seconds: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn moby_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/models/gdn-moby")
    }

    fn moby() -> TextTokenizer {
        TextTokenizer::load(&moby_dir(), None, &serde_json::json!({ "eos_token_id": 2 })).unwrap()
    }

    #[test]
    fn split_is_at_the_last_space_with_the_space_in_the_target() {
        assert_eq!(split("He opened the door"), Some(("He opened the", " door")));
        // Punctuation and a trailing newline stay in the target (split(' ') keeps them).
        assert_eq!(split("She said goodbye.\n"), Some(("She said", " goodbye.\n")));
        // Only U+0020 splits: a tab or newline before the last word does not.
        assert_eq!(split("one two\tthree"), Some(("one", " two\tthree")));
        assert_eq!(split("one two\nthree"), Some(("one", " two\nthree")));
    }

    #[test]
    fn whitespace_ending_the_context_moves_into_the_target() {
        // lm-eval: context "a b " (join of "a", "b", ""), rstripped to "a b" by _encode_pair.
        assert_eq!(split("a b  c"), Some(("a b", "  c")));
        assert_eq!(split("end of line\n last"), Some(("end of line", "\n last")));
        // A text ending in a space has the target " " (the last split element is empty).
        assert_eq!(split("trailing space "), Some(("trailing space", " ")));
        assert_eq!(split("x \u{1f} y"), Some(("x", " \u{1f} y")));
    }

    #[test]
    fn texts_without_a_context_are_not_split() {
        for t in ["", "word", " word", "   word", "\n word"] {
            assert_eq!(split(t), None, "{t:?}");
        }
    }

    #[test]
    fn split_parts_join_to_the_text() {
        for t in ["a b", "a  b", "x y z.\n", "über straße ", "a\u{a0} b"] {
            let (c, w) = split(t).unwrap();
            assert_eq!(format!("{c}{w}"), t);
            assert!(w.starts_with(char::is_whitespace) && !c.ends_with(char::is_whitespace), "{t:?}");
        }
    }

    #[test]
    fn multi_token_targets_are_the_tail_of_the_whole_text() {
        let tok = moby();
        let text = "The harpooneer stood in the bows of the whaleboat";
        let (c, w) = split(text).unwrap();
        let d = tokenize(&tok, c, w, 512).unwrap().unwrap();
        let whole = tok.encode(text).unwrap();
        assert!(d.targets.len() > 1, "a rare word takes several tokens: {:?}", d.targets);
        assert_eq!(tok.decode(&d.targets).unwrap(), " whaleboat");
        assert_eq!(d.targets, whole[whole.len() - d.targets.len()..]);
        assert_eq!(d.input, whole[..whole.len() - 1]);
        assert!(!d.truncated);
    }

    #[test]
    fn long_contexts_are_cut_from_the_left() {
        let whole: Vec<u32> = (10..30).collect();
        let d = doc(whole.clone(), 17, 5).unwrap();
        // The last seqlen + 1 tokens, minus the final one, are read.
        assert_eq!(d.input, [24, 25, 26, 27, 28]);
        assert_eq!(d.targets, [27, 28, 29]);
        assert!(d.truncated);
        let d = doc(whole.clone(), 17, 19).unwrap();
        assert_eq!((d.input.len(), d.truncated), (19, false));
        assert_eq!(doc(whole.clone(), 17, 2), Err(Unscored::LongTarget));
        assert_eq!(doc(whole.clone(), 20, 8), Err(Unscored::NoTarget));
        assert_eq!(doc(whole, 0, 64), Err(Unscored::NoTarget));
    }

    #[test]
    fn default_special_tokens_prefix_the_context_not_the_target() {
        // The same tokenizer with a BOS template, as Llama-style tokenizers have.
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(moby_dir().join("tokenizer.json")).unwrap()).unwrap();
        let bos = serde_json::json!({ "SpecialToken": { "id": "<s>", "type_id": 0 } });
        let seq = |id: &str| serde_json::json!({ "Sequence": { "id": id, "type_id": 0 } });
        json["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [bos, seq("A")],
            "pair": [bos, seq("A"), seq("B")],
            "special_tokens": { "<s>": { "id": "<s>", "ids": [1], "tokens": ["<s>"] } },
        });
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokenizer.json");
        std::fs::write(&file, json.to_string()).unwrap();
        let tok = TextTokenizer::load(dir.path(), Some(&file), &serde_json::json!({ "eos_token_id": 2 })).unwrap();
        let d = tokenize(&tok, "Call me", " Ishmael", 512).unwrap().unwrap();
        assert_eq!(d.input[0], 1);
        assert_eq!(tok.decode(&d.targets).unwrap(), " Ishmael");
        assert!(!d.targets.contains(&1));
    }

    #[test]
    fn batches_are_padded_to_their_longest() {
        let docs: Vec<Doc> =
            [3, 2, 2, 1].iter().map(|&n| Doc { input: vec![7; n], targets: vec![7], truncated: false }).collect();
        let refs: Vec<&Doc> = docs.iter().collect();
        let p = padded(&refs, 2, 0);
        assert_eq!(p, [vec![7, 7, 7], vec![7, 7, 0], vec![7, 7], vec![7, 0]]);
    }
}
