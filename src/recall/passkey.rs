//! Passkey retrieval: a five-digit number stated once at a chosen depth of natural filler text,
//! asked for at the end; the answer is read by greedy decoding and must match exactly.
//!
//! Each prompt is exactly `length` tokens: the instruction, filler tokens (a seeded window of the
//! filler text's token stream) with the needle inserted at `depth` of the filler, and the question.

use super::{argmax_rows, Bucket};
use crate::arch::{CausalLm, DecodeCache, NoObserver};
use crate::cli::RecallArgs;
use crate::data::{TextSource, TextTokenizer};
use anyhow::{bail, Result};
use candle_core::Tensor;
use rand::{rngs::StdRng, Rng, SeedableRng};

const INSTRUCTION: &str =
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about it.\n";
const QUESTION: &str = "\nWhat is the pass key? The pass key is";
/// Tokens generated per answer: enough for five digits in any byte-level BPE.
const ANSWER_TOKENS: usize = 8;
/// Prompt tokens per forward pass: long prompts are prefilled in chunks through the cache.
const PREFILL_CHUNK: usize = 2048;

fn needle(key: u32) -> String {
    format!(" The pass key is {key}. Remember it. {key} is the pass key. ")
}

pub(super) fn check(a: &RecallArgs) -> Result<()> {
    if a.lengths.is_empty() || a.lengths.iter().any(|l| *l < 128) {
        bail!("passkey: --lengths must be at least 128 tokens each");
    }
    if a.depths.is_empty() || a.depths.iter().any(|d| !(0.0..=1.0).contains(d)) {
        bail!("passkey: --depths must be fractions in [0, 1]");
    }
    Ok(())
}

/// Prompts of one (length, depth) cell and their keys.
fn prompts(
    a: &RecallArgs,
    tok: &TextTokenizer,
    filler: &[u32],
    length: usize,
    depth: f64,
) -> Result<Vec<(Vec<u32>, u32)>> {
    let (head, tail) = (tok.encode(INSTRUCTION)?, tok.encode(QUESTION)?);
    let mut out = Vec::new();
    for i in 0..a.samples {
        let seed = a.task_seed ^ ((length as u64) << 20) ^ (((depth * 1000.0) as u64) << 8) ^ i as u64;
        let mut rng = StdRng::seed_from_u64(seed);
        let key = rng.random_range(10_000..100_000u32);
        let n = tok.encode(&needle(key))?;
        let room = length.checked_sub(head.len() + n.len() + tail.len()).filter(|r| *r > 0);
        let Some(room) = room else { bail!("passkey: --lengths {length} is too short for the prompt") };
        if filler.len() < room {
            bail!(
                "passkey: the filler text has {} tokens, fewer than the {room} a {length}-token prompt needs; pass a longer --filler",
                filler.len()
            );
        }
        let off = rng.random_range(0..=filler.len() - room);
        let body = &filler[off..off + room];
        let at = (depth * room as f64).round() as usize;
        let mut p = head.clone();
        p.extend_from_slice(&body[..at]);
        p.extend_from_slice(&n);
        p.extend_from_slice(&body[at..]);
        p.extend_from_slice(&tail);
        out.push((p, key));
    }
    Ok(out)
}

/// Greedy continuation of equal-length `prompts` by `steps` tokens: through the decoding cache
/// (prefilled in chunks), or by re-reading the whole sequence for families without one.
fn greedy(model: &dyn CausalLm, prompts: &[Vec<u32>], steps: usize) -> Result<Vec<Vec<u32>>> {
    let (b, len) = (prompts.len(), prompts[0].len());
    let dev = model.device();
    let mut cache = DecodeCache::default();
    let mut last = None;
    let mut cached = true;
    for start in (0..len).step_by(PREFILL_CHUNK) {
        let n = PREFILL_CHUNK.min(len - start);
        let flat: Vec<u32> = prompts.iter().flat_map(|p| p[start..start + n].iter().copied()).collect();
        match model.forward_cached(&Tensor::from_vec(flat, (b, n), dev)?, &mut cache) {
            Ok(l) => last = Some(l.narrow(1, n - 1, 1)?.squeeze(1)?),
            Err(_) if start == 0 => {
                cached = false;
                break;
            }
            Err(e) => return Err(e),
        }
    }
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut out = vec![Vec::new(); b];
    for _ in 0..steps {
        let logits = match (&last, cached) {
            (Some(l), true) => l.clone(),
            _ => {
                let l = seqs[0].len();
                let flat: Vec<u32> = seqs.iter().flatten().copied().collect();
                let logits = model.forward(&Tensor::from_vec(flat, (b, l), dev)?, &mut NoObserver)?;
                logits.narrow(1, l - 1, 1)?.squeeze(1)?
            }
        };
        let next = argmax_rows(&logits)?;
        for (i, t) in next.iter().enumerate() {
            out[i].push(*t);
            seqs[i].push(*t);
        }
        if cached {
            let ids = Tensor::from_vec(next, (b, 1), dev)?;
            last = Some(model.forward_cached(&ids, &mut cache)?.squeeze(1)?);
        }
    }
    Ok(out)
}

/// The first run of digits in `text`, if it begins within the leading whitespace.
fn leading_number(text: &str) -> Option<u32> {
    let t = text.trim_start();
    let digits: String = t.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// (correct, total, one bucket per length and depth).
pub(super) fn run(
    a: &RecallArgs,
    model: &dyn CausalLm,
    tok: &TextTokenizer,
    quiet: bool,
) -> Result<(usize, usize, Vec<Bucket>)> {
    let src = TextSource::parse(a.filler.as_deref(), "text")?;
    let longest = a.lengths.iter().copied().max().unwrap_or(0);
    // Window offsets need room beyond one prompt's worth of filler.
    let filler = tok.stream(src.documents()?, 2 * longest)?;
    let cells = a.lengths.len() * a.depths.len();
    let pb = crate::progress::bar(cells as u64, "passkey", quiet);
    let mut buckets = Vec::new();
    for &length in &a.lengths {
        for &depth in &a.depths {
            let ps = prompts(a, tok, &filler, length, depth)?;
            let mut correct = 0;
            for chunk in ps.chunks(8) {
                let texts: Vec<Vec<u32>> = chunk.iter().map(|(p, _)| p.clone()).collect();
                for (gen, (_, key)) in greedy(model, &texts, ANSWER_TOKENS)?.iter().zip(chunk) {
                    if leading_number(&tok.decode(gen)?) == Some(*key) {
                        correct += 1;
                    }
                }
            }
            buckets.push(Bucket::new(format!("len {length} depth {depth}"), correct, ps.len()));
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    let correct = buckets.iter().map(|b| b.correct).sum();
    Ok((correct, cells * a.samples, buckets))
}

#[cfg(test)]
mod tests {
    use super::leading_number;

    #[test]
    fn answers_are_read_exactly() {
        assert_eq!(leading_number(" 12345. Remember"), Some(12345));
        assert_eq!(leading_number("12345"), Some(12345));
        assert_eq!(leading_number(" the 12345"), None);
        assert_eq!(leading_number(" 1234"), Some(1234));
    }
}
