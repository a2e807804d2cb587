//! One copy of the weights for the student and its teacher. The teacher (the unpruned model)
//! loads first and every tensor it reads is pooled; the student then takes from the pool every
//! tensor whose stored bytes equal the teacher's, so only the pruned slices (and what trains)
//! exist twice.

use crate::arch::StateLayout;
use crate::checkpoint::{Checkpoint, WeightFormat};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// Tensors loaded once, by checkpoint name.
#[derive(Clone, Default)]
pub struct Pool(Arc<Mutex<HashMap<String, Tensor>>>);

impl Pool {
    /// `weights`, with every tensor read through it added to the pool.
    pub fn recording(&self, weights: VarBuilder<'static>) -> VarBuilder<'static> {
        self.wrap(weights, None)
    }

    /// `weights`, reading the tensors named in `same` from the pool where they are there.
    pub fn reusing(&self, weights: VarBuilder<'static>, same: Arc<BTreeSet<String>>) -> VarBuilder<'static> {
        self.wrap(weights, Some(same))
    }

    fn wrap(&self, inner: VarBuilder<'static>, reuse: Option<Arc<BTreeSet<String>>>) -> VarBuilder<'static> {
        let (dtype, device) = (inner.dtype(), inner.device().clone());
        VarBuilder::from_backend(Box::new(Pooled { inner, pool: self.clone(), reuse }), dtype, device)
    }
}

/// A backend that either records what it loads into the pool (`reuse` is None) or takes the
/// tensors named in `reuse` from it.
struct Pooled {
    inner: VarBuilder<'static>,
    pool: Pool,
    reuse: Option<Arc<BTreeSet<String>>>,
}

impl Pooled {
    /// The pooled tensor `name` in `dtype` (and `shape`, when given), if this backend reuses it.
    fn pooled(&self, name: &str, shape: Option<&Shape>, dtype: DType) -> Option<Tensor> {
        if !self.reuse.as_ref()?.contains(name) {
            return None;
        }
        let pool = self.pool.0.lock().expect("weight pool poisoned");
        pool.get(name).filter(|t| shape.is_none_or(|s| t.shape() == s) && t.dtype() == dtype).cloned()
    }

    fn loaded(&self, name: &str, t: Tensor) -> Tensor {
        if self.reuse.is_none() {
            self.pool.0.lock().expect("weight pool poisoned").insert(name.to_string(), t.clone());
        }
        t
    }
}

impl SimpleBackend for Pooled {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        _: &Device,
    ) -> Result<Tensor, candle_core::Error> {
        if let Some(t) = self.pooled(name, Some(&s), dtype) {
            return Ok(t);
        }
        Ok(self.loaded(name, self.inner.get_with_hints_dtype(s, name, h, dtype)?))
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> Result<Tensor, candle_core::Error> {
        if let Some(t) = self.pooled(name, None, dtype) {
            return Ok(t);
        }
        Ok(self.loaded(name, self.inner.get_unchecked_dtype(name, dtype)?))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// The stored bytes of each tensor of a checkpoint (a PyTorch pickle is read once, whole).
struct Stored<'a> {
    ckpt: &'a Checkpoint,
    pickle: Option<HashMap<String, Vec<u8>>>,
}

impl<'a> Stored<'a> {
    fn open(ckpt: &'a Checkpoint) -> Result<Self> {
        let pickle = match ckpt.format {
            WeightFormat::Safetensors => None,
            WeightFormat::PytorchBin => {
                let src = &ckpt.files[0];
                let all = candle_core::pickle::read_all(src).with_context(|| format!("reading {}", src.display()))?;
                let raw = all
                    .into_iter()
                    .map(|(n, t)| Ok((n, crate::surgery::raw_of(&t)?.data.into_owned())))
                    .collect::<Result<_>>()?;
                Some(raw)
            }
        };
        Ok(Self { ckpt, pickle })
    }

    fn bytes(&self, name: &str) -> Result<Vec<u8>> {
        match &self.pickle {
            Some(p) => p.get(name).cloned().with_context(|| format!("tensor {name} not found")),
            None => {
                let info = self.ckpt.info(name)?;
                crate::checkpoint::read_bytes(info).with_context(|| format!("reading {}", info.file.display()))
            }
        }
    }
}

/// How a student relates to its teacher.
#[derive(Debug, Clone, Default)]
pub struct Relation {
    /// Tensors stored with the same bytes in both: the student shares the teacher's copy.
    pub same: BTreeSet<String>,
    /// Per pruned layer and key head, the teacher's channels the student kept (empty when the
    /// student is unrelated and that was allowed).
    pub kept: BTreeMap<usize, Vec<Vec<usize>>>,
    /// Tensors that differ other than by pruning (allowed with `--allow-unrelated-teacher`).
    pub differing: Vec<String>,
}

/// Check that `student` is a pruned copy of `teacher`: the same family and tensors, every
/// tensor outside the key/query slices byte for byte, and each kept key channel one of the
/// teacher's channels of the same head, in order. With `allow_unrelated` only the family, the
/// tensor names and the vocabulary must agree.
pub fn relate(
    teacher: &Checkpoint,
    t_layout: &StateLayout,
    student: &Checkpoint,
    s_layout: &StateLayout,
    allow_unrelated: bool,
) -> Result<Relation> {
    let (tt, st) = (teacher.model_type()?, student.model_type()?);
    if tt != st {
        bail!("the teacher is a {tt} model and the student a {st} model; distil from the model the student was pruned from");
    }
    let unrelated = |what: String| -> anyhow::Error {
        anyhow::anyhow!(
            "{what}: the student is not a pruned copy of the teacher; pass the model it was pruned from, or --allow-unrelated-teacher to distil anyway"
        )
    };
    if s_layout.dk > t_layout.dk {
        bail!(
            "the student's key width {} is above the teacher's {}: the teacher must be the unpruned model",
            s_layout.dk,
            t_layout.dk
        );
    }
    let s_layers: Vec<usize> = s_layout.layers.iter().map(|l| l.layer).collect();
    let t_layers: Vec<usize> = t_layout.layers.iter().map(|l| l.layer).collect();
    if s_layers != t_layers {
        bail!("the student's recurrent layers {s_layers:?} differ from the teacher's {t_layers:?}");
    }
    let sliced: BTreeSet<&str> =
        s_layout.layers.iter().flat_map(|l| l.slices.iter().map(|s| s.tensor.as_str())).collect();
    for name in student.tensors.keys() {
        if !teacher.tensors.contains_key(name) {
            bail!("the student has {name}, which the teacher lacks: distil from the model the student was pruned from");
        }
    }
    if let Some(name) = teacher.tensors.keys().find(|n| !student.tensors.contains_key(*n)) {
        bail!("the teacher has {name}, which the student lacks: distil from the model the student was pruned from");
    }
    let (t_bytes, s_bytes) = (Stored::open(teacher)?, Stored::open(student)?);
    let mut rel = Relation::default();
    for (name, info) in &student.tensors {
        let t_info = &teacher.tensors[name];
        if sliced.contains(name.as_str()) {
            continue;
        }
        if info.shape != t_info.shape {
            // The vocabulary and the widths must agree whatever the relation.
            bail!(
                "{name} has shape {:?} in the student and {:?} in the teacher; the two models must share their vocabulary and widths",
                info.shape,
                t_info.shape
            );
        }
        if info.dtype == t_info.dtype && s_bytes.bytes(name)? == t_bytes.bytes(name)? {
            rel.same.insert(name.clone());
        } else if allow_unrelated {
            rel.differing.push(name.clone());
        } else {
            return Err(unrelated(format!("{name} differs between the student and the teacher")));
        }
    }
    for (s_l, t_l) in s_layout.layers.iter().zip(&t_layout.layers) {
        match kept_channels(&t_bytes, t_layout.dk, t_l, &s_bytes, s_layout.dk, s_l, student) {
            Ok(k) => {
                rel.kept.insert(s_l.layer, k);
            }
            Err(e) if allow_unrelated => rel.differing.push(format!("layer {} key channels ({e})", s_l.layer)),
            Err(e) => return Err(unrelated(format!("layer {}: {e}", s_l.layer))),
        }
    }
    Ok(rel)
}

/// A sliced tensor's stored bytes in the student and the teacher, the bytes of one row, and the
/// teacher's row count.
type SlicedBytes = (Vec<u8>, Vec<u8>, usize, usize);

/// The teacher channels of each key head that the student's channels are, found by their
/// stored rows across every slice of the layer; the rows outside the slices must be equal too.
fn kept_channels(
    t_bytes: &Stored,
    t_dk: usize,
    t_l: &crate::arch::LayerState,
    s_bytes: &Stored,
    s_dk: usize,
    s_l: &crate::arch::LayerState,
    student: &Checkpoint,
) -> Result<Vec<Vec<usize>>> {
    if s_l.slices.len() != t_l.slices.len() || s_l.key_heads != t_l.key_heads {
        bail!("the student's key heads or slices differ from the teacher's");
    }
    let mut tensors: BTreeMap<&str, SlicedBytes> = BTreeMap::new();
    for s in &s_l.slices {
        if !tensors.contains_key(s.tensor.as_str()) {
            let (sb, tb) = (s_bytes.bytes(&s.tensor)?, t_bytes.bytes(&s.tensor)?);
            let s_rows = student.info(&s.tensor)?.shape[0].max(1);
            if !t_l.slices.iter().any(|t| t.tensor == s.tensor) {
                bail!("the teacher does not slice {}", s.tensor);
            }
            let row = sb.len() / s_rows;
            let t_n = tb.len().checked_div(row).unwrap_or(0);
            tensors.insert(&s.tensor, (sb, tb, row, t_n));
        }
    }
    // A channel's signature: its rows in every slice, concatenated.
    let signature = |l: &crate::arch::LayerState, h: usize, j: usize, teacher: bool| -> Vec<u8> {
        let mut sig = Vec::new();
        for s in &l.slices {
            let (sb, tb, row, _) = &tensors[s.tensor.as_str()];
            let data = if teacher { tb } else { sb };
            let r = s.offset + h * s.head_stride + j;
            sig.extend_from_slice(data.get(r * row..(r + 1) * row).unwrap_or_default());
        }
        sig
    };
    let mut kept = Vec::with_capacity(s_l.key_heads);
    for h in 0..s_l.key_heads {
        let by_sig: HashMap<Vec<u8>, usize> = (0..t_dk).rev().map(|j| (signature(t_l, h, j, true), j)).collect();
        let mut chans = Vec::with_capacity(s_dk);
        for j in 0..s_dk {
            let c = by_sig.get(&signature(s_l, h, j, false)).copied();
            match c {
                Some(c) if chans.last().is_none_or(|&p| p < c) => chans.push(c),
                _ => bail!("key channel {j} of head {h} is none of the teacher's channels of that head, in order"),
            }
        }
        kept.push(chans);
    }
    // Rows outside the key/query slices (values, gates, the conv's value channels) are untouched by pruning.
    for (name, (sb, tb, row, t_n)) in &tensors {
        let outside = |l: &crate::arch::LayerState, dk: usize, n: usize| -> Vec<usize> {
            let mut inside = BTreeSet::new();
            for s in l.slices.iter().filter(|s| s.tensor == *name) {
                for h in 0..l.key_heads {
                    inside.extend((0..dk).map(|j| s.offset + h * s.head_stride + j));
                }
            }
            (0..n).filter(|r| !inside.contains(r)).collect()
        };
        let s_n = sb.len().checked_div(*row).unwrap_or(0);
        let (so, to) = (outside(s_l, s_dk, s_n), outside(t_l, t_dk, *t_n));
        let differs = so.len() != to.len()
            || so.iter().zip(&to).any(|(a, b)| sb[a * row..(a + 1) * row] != tb[b * row..(b + 1) * row]);
        if differs {
            bail!("{name} differs outside its key/query rows");
        }
    }
    Ok(kept)
}
