//! The trained parameters: float32 values that the optimizer updates, and the model's views of
//! them. The model reads each trained tensor through a variable in its compute dtype; before a
//! step the variable is set from the parameters (the base plus (α/r)·B·A for an adapter), and
//! after the backward pass the variable's gradient G gives the parameters' gradients
//! (∂A = (α/r)·Bᵀ·G, ∂B = (α/r)·G·Aᵀ). No layer knows it is being adapted.

use super::plan::{How, Plan};
use crate::arch::trainable::Trainable;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// How one trained checkpoint tensor is made from the parameters.
enum Slot {
    Lora { name: String, var: Var, base: Tensor, a: usize, b: usize, scale: f64 },
    Full { name: String, var: Var, p: usize },
}

/// The parameters of one recovery run.
pub struct ParamSet {
    /// Parameter names: a tensor trained whole keeps its checkpoint name; an adapter adds
    /// `.lora_A` / `.lora_B` to the name of the tensor it adapts.
    pub names: Vec<String>,
    /// Float32 values, on the model's device.
    pub values: Vec<Tensor>,
    slots: Vec<Slot>,
}

/// The name of an adapter factor of a checkpoint tensor (`x.q_proj.weight` → `x.q_proj.lora_A`).
pub fn factor_name(tensor: &str, factor: &str) -> String {
    format!("{}.{factor}", tensor.strip_suffix(".weight").unwrap_or(tensor))
}

impl ParamSet {
    /// Parameters for the tensors of `plan` that `set` loaded: adapters of rank `rank` with
    /// scale `alpha / rank`, A drawn as PEFT draws it (uniform in ±1/√inputs) from `seed` and
    /// B zero, so that training starts from the loaded model exactly.
    pub fn new(plan: &Plan, set: &Trainable, rank: usize, alpha: f64, seed: u64) -> Result<Self> {
        let (vars, bases) = (set.vars(), set.bases());
        let mut out = Self { names: Vec::new(), values: Vec::new(), slots: Vec::new() };
        for (i, (name, how)) in plan.iter().enumerate() {
            let var =
                vars.get(name).with_context(|| format!("--train selects {name}, which the model does not read"))?;
            let dev = var.device().clone();
            match how {
                How::Full => {
                    out.slots.push(Slot::Full { name: name.clone(), var: var.clone(), p: out.values.len() });
                    out.names.push(name.clone());
                    // A copy: in float32 the conversion would share the variable's storage.
                    out.values.push(var.as_tensor().to_dtype(DType::F32)?.copy()?);
                }
                How::Lora => {
                    let base = bases.get(name).with_context(|| format!("no frozen base for {name}"))?.clone();
                    let (rows, cols) = base.dims2().with_context(|| format!("{name} is not a matrix"))?;
                    if rank > rows.min(cols) {
                        bail!(
                            "--lora-rank {rank} is above the width of {name} ({rows} x {cols}); use at most {}",
                            rows.min(cols)
                        );
                    }
                    // One stream per tensor, so that adding a tensor to the plan leaves the others' draws alone.
                    let mut rng = rand::rngs::StdRng::seed_from_u64(crate::calib::sequence_seed(seed, i));
                    let bound = 1.0 / (cols as f32).sqrt();
                    let a: Vec<f32> = (0..rank * cols).map(|_| rng.random_range(-bound..bound)).collect();
                    let a = Tensor::from_vec(a, (rank, cols), &dev)?;
                    let b = Tensor::zeros((rows, rank), DType::F32, &dev)?;
                    let (ia, ib) = (out.values.len(), out.values.len() + 1);
                    out.names.push(factor_name(name, "lora_A"));
                    out.names.push(factor_name(name, "lora_B"));
                    out.values.extend([a, b]);
                    let scale = alpha / rank as f64;
                    out.slots.push(Slot::Lora { name: name.clone(), var: var.clone(), base, a: ia, b: ib, scale });
                }
            }
        }
        Ok(out)
    }

    /// Number of trained scalars.
    pub fn elems(&self) -> usize {
        self.values.iter().map(Tensor::elem_count).sum()
    }

    /// The (α/r)·B·A of an adapter, float32.
    fn delta(&self, a: usize, b: usize, scale: f64) -> Result<Tensor> {
        Ok((self.values[b].matmul(&self.values[a])? * scale)?)
    }

    /// Set the model's variables from the parameters.
    pub fn refresh(&self) -> Result<()> {
        for s in &self.slots {
            match s {
                Slot::Full { var, p, .. } => var.set(&self.values[*p].to_dtype(var.dtype())?)?,
                Slot::Lora { var, base, a, b, scale, .. } => {
                    let w = (base.to_dtype(DType::F32)? + self.delta(*a, *b, *scale)?)?;
                    var.set(&w.to_dtype(var.dtype())?)?;
                }
            }
        }
        Ok(())
    }

    /// The model's variables, by checkpoint name (what a backward pass gives gradients for).
    pub fn vars(&self) -> Vec<(String, Var)> {
        self.slots
            .iter()
            .map(|s| match s {
                Slot::Full { name, var, .. } | Slot::Lora { name, var, .. } => (name.clone(), var.clone()),
            })
            .collect()
    }

    /// The parameters' gradients from the variables' (`by_var`, by checkpoint name; a variable
    /// no loss reached has a zero gradient).
    pub fn grads(&self, by_var: &HashMap<String, Tensor>) -> Result<Vec<Tensor>> {
        let mut out: Vec<Option<Tensor>> = vec![None; self.values.len()];
        for s in &self.slots {
            match s {
                Slot::Full { name, p, .. } => {
                    out[*p] = by_var.get(name).map(|g| g.to_dtype(DType::F32)).transpose()?;
                }
                Slot::Lora { name, a, b, scale, .. } => {
                    if let Some(g) = by_var.get(name) {
                        let g = g.to_dtype(DType::F32)?;
                        out[*a] = Some((self.values[*b].t()?.matmul(&g)? * *scale)?);
                        out[*b] = Some((g.matmul(&self.values[*a].t()?)? * *scale)?);
                    }
                }
            }
        }
        out.into_iter().zip(&self.values).map(|(g, v)| g.map_or_else(|| Ok(v.zeros_like()?), Ok)).collect()
    }

    /// What training changed, by checkpoint name: the (α/r)·B·A to add to an adapted tensor,
    /// or the new value of a tensor trained whole; float32, on the CPU.
    pub fn updates(&self) -> Result<Vec<(String, Update)>> {
        let cpu = candle_core::Device::Cpu;
        self.slots
            .iter()
            .map(|s| {
                Ok(match s {
                    Slot::Full { name, p, .. } => (name.clone(), Update::Value(self.values[*p].to_device(&cpu)?)),
                    Slot::Lora { name, a, b, scale, .. } => {
                        (name.clone(), Update::Add(self.delta(*a, *b, *scale)?.to_device(&cpu)?))
                    }
                })
            })
            .collect()
    }

    /// The adapters: checkpoint name, A [r, in] and B [out, r] (float32, CPU).
    pub fn adapters(&self) -> Result<Vec<(String, Tensor, Tensor)>> {
        let cpu = candle_core::Device::Cpu;
        self.slots
            .iter()
            .filter_map(|s| match s {
                Slot::Lora { name, a, b, .. } => Some((name, *a, *b)),
                Slot::Full { .. } => None,
            })
            .map(|(name, a, b)| Ok((name.clone(), self.values[a].to_device(&cpu)?, self.values[b].to_device(&cpu)?)))
            .collect()
    }
}

/// A change to one stored tensor.
pub enum Update {
    /// Add this to the stored tensor (a merged adapter).
    Add(Tensor),
    /// Replace the stored tensor.
    Value(Tensor),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::trainable::Selector;
    use candle_core::Device;
    use candle_nn::VarBuilder;
    use std::sync::Arc;

    /// A 3 x 5 weight adapted at rank 2, and a bias trained whole.
    fn set_up() -> Result<(ParamSet, Tensor)> {
        let dev = Device::Cpu;
        let w = Tensor::arange(0f32, 15.0, &dev)?.reshape((3, 5))?;
        let tensors = HashMap::from([
            ("p.weight".to_string(), w.clone()),
            ("p.bias".to_string(), Tensor::ones(3, DType::F32, &dev)?),
        ]);
        let set = Trainable::keeping_bases();
        let all: Selector = Arc::new(|_: &str| true);
        let vb = set.wrap(VarBuilder::from_tensors(tensors, DType::F32, &dev), all);
        vb.get((3, 5), "p.weight")?;
        vb.get(3, "p.bias")?;
        let plan = Plan::from([("p.weight".to_string(), How::Lora), ("p.bias".to_string(), How::Full)]);
        Ok((ParamSet::new(&plan, &set, 2, 4.0, 1)?, w))
    }

    /// The variable is W + (α/r)·B·A, and the factors' gradients are the chain rule through it,
    /// checked against finite differences of a linear loss ⟨G, W + (α/r)·B·A⟩.
    #[test]
    fn adapter_gradients_follow_the_chain_rule() -> Result<()> {
        let (mut ps, w) = set_up()?;
        let dev = Device::Cpu;
        let (ia, ib) = (
            ps.names.iter().position(|n| n == "p.lora_A").unwrap(),
            ps.names.iter().position(|n| n == "p.lora_B").unwrap(),
        );
        // B starts at zero: the adapted weight is the base until training moves B.
        ps.refresh()?;
        let var = ps.vars().into_iter().find(|(n, _)| n == "p.weight").unwrap().1;
        assert_eq!(var.as_tensor().to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        ps.values[ib] = Tensor::new(&[[0.5f32, -1.0], [2.0, 0.25], [-0.75, 1.5]], &dev)?;
        ps.refresh()?;
        let want = (&w + (ps.values[ib].matmul(&ps.values[ia])? * 2.0)?)?;
        assert_eq!(var.as_tensor().to_vec2::<f32>()?, want.to_vec2::<f32>()?);
        let g = Tensor::new(
            &[[1f32, -2.0, 0.5, 0.0, 3.0], [0.25, 1.0, -1.0, 2.0, 0.5], [-0.5, 0.0, 1.5, 1.0, -2.0]],
            &dev,
        )?;
        let grads = ps.grads(&HashMap::from([("p.weight".to_string(), g.clone())]))?;
        let loss = |ps: &ParamSet| -> Result<f64> {
            let wv = (&w + (ps.values[ib].matmul(&ps.values[ia])? * 2.0)?)?;
            Ok((wv * &g)?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?)
        };
        for (i, grad) in [(ia, &grads[ia]), (ib, &grads[ib])] {
            let flat = grad.flatten_all()?.to_vec1::<f32>()?;
            for (j, gj) in flat.iter().enumerate() {
                let h = 1e-2f32;
                let (start, shape) = (ps.values[i].flatten_all()?.to_vec1::<f32>()?, ps.values[i].shape().clone());
                let bump = |s: f32| -> Result<Tensor> {
                    let mut v = start.clone();
                    v[j] += s;
                    Ok(Tensor::from_vec(v, shape.clone(), &dev)?)
                };
                let keep = ps.values[i].clone();
                ps.values[i] = bump(h)?;
                let up = loss(&ps)?;
                ps.values[i] = bump(-h)?;
                let down = loss(&ps)?;
                ps.values[i] = keep;
                let fd = (up - down) / (2.0 * h as f64);
                assert!((*gj as f64 - fd).abs() < 1e-3 * fd.abs().max(1.0), "{}[{j}]: {gj} vs {fd}", ps.names[i]);
            }
        }
        // A tensor no loss reached has a zero gradient; a whole tensor's is the variable's.
        let ibias = ps.names.iter().position(|n| n == "p.bias").unwrap();
        assert_eq!(grads[ibias].to_vec1::<f32>()?, vec![0.0; 3]);
        Ok(())
    }

    #[test]
    fn rank_above_the_width_is_refused() -> Result<()> {
        let (_, _) = set_up()?;
        let dev = Device::Cpu;
        let set = Trainable::keeping_bases();
        let all: Selector = Arc::new(|_: &str| true);
        let tensors = HashMap::from([("p.weight".to_string(), Tensor::zeros((3, 5), DType::F32, &dev)?)]);
        set.wrap(VarBuilder::from_tensors(tensors, DType::F32, &dev), all).get((3, 5), "p.weight")?;
        let plan = Plan::from([("p.weight".to_string(), How::Lora)]);
        let err = ParamSet::new(&plan, &set, 4, 8.0, 0).err().expect("rank 4 of a 3 x 5 weight").to_string();
        assert!(err.contains("--lora-rank 4 is above the width of p.weight"), "{err}");
        Ok(())
    }
}
