//! The linear projection every layer loads its projections through: a frozen base weight
//! [out, in] in any dtype (possibly a view of rows or columns of a stacked tensor), an optional
//! bias, and an optional float32 low-rank adapter `scale · B·A` that can be merged into it.

use anyhow::{bail, ensure, Result};
use candle_core::{DType, Module, Tensor, Var};
use candle_nn::VarBuilder;

/// A low-rank update `scale · B·A` of a weight [out, in]: `a` [r, in], `b` [out, r], float32.
#[derive(Debug, Clone)]
pub struct Adapter {
    pub a: Var,
    pub b: Var,
    pub scale: f64,
}

impl Adapter {
    /// `scale · B·A` [out, in] in float32.
    pub fn delta(&self) -> Result<Tensor> {
        Ok((self.b.as_tensor().matmul(self.a.as_tensor())? * self.scale)?)
    }
}

/// y = x·Wᵀ (+ bias) (+ scale · (x·Aᵀ)·Bᵀ).
#[derive(Debug, Clone)]
pub struct Linear {
    /// The base: candle's own layer, so that without an adapter the forward is candle's op for op.
    base: candle_nn::Linear,
    /// Boxed: most projections have none, and layers hold many projections.
    adapter: Option<Box<Adapter>>,
    /// Boxed, as the adapter: the name and the variable, for a projection loaded whole.
    named: Option<Box<Named>>,
}

/// A projection loaded whole: its weight's checkpoint name, and the weight as a variable when
/// it trains (a view of rows or columns has neither).
#[derive(Debug, Clone)]
struct Named {
    name: String,
    var: Option<Var>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { base: candle_nn::Linear::new(weight, bias), adapter: None, named: None }
    }

    /// `weight` [out_dim, in_dim] (and `bias` [out_dim]) under `vb`: `candle_nn::linear_b`,
    /// whose initialisation hints a `VarMap` builder follows.
    pub fn load(vb: VarBuilder, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let named = Some(Box::new(Named { name: format!("{}.weight", vb.prefix()), var: None }));
        Ok(Self { base: candle_nn::linear_b(in_dim, out_dim, bias, vb)?, adapter: None, named })
    }

    /// The projection `name` under `vb`; with `grad` its weight is a variable (see
    /// [`Linear::trainable`]), so that a loss can be differentiated with respect to it.
    pub fn load_trainable(
        vb: &VarBuilder,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        grad: bool,
    ) -> Result<Self> {
        let lin = Self::load(vb.pp(name), in_dim, out_dim, bias)?;
        if grad {
            lin.trainable()
        } else {
            Ok(lin)
        }
    }

    /// The same projection with its base weight a variable, which [`Linear::params`] reports
    /// under the weight's checkpoint name.
    pub fn trainable(self) -> Result<Self> {
        let Some(named) = &self.named else { bail!("only a projection loaded under its checkpoint name can train") };
        let var = Var::from_tensor(self.weight())?;
        let base = candle_nn::Linear::new(var.as_tensor().clone(), self.bias().cloned());
        let named = Some(Box::new(Named { name: named.name.clone(), var: Some(var) }));
        Ok(Self { base, named, ..self })
    }

    /// The trained tensors of this projection, named as the checkpoint names them: the base
    /// weight when it trains, and an adapter's factors as `<name>.lora_A` / `<name>.lora_B`
    /// (PEFT's names, `.weight` dropped).
    pub fn params(&self, out: &mut Vec<(String, Var)>) {
        let Some(Named { name, var }) = self.named.as_deref() else { return };
        if let Some(v) = var {
            out.push((name.clone(), v.clone()));
        }
        if let Some(ad) = &self.adapter {
            let stem = name.strip_suffix(".weight").unwrap_or(name);
            out.push((format!("{stem}.lora_A"), ad.a.clone()));
            out.push((format!("{stem}.lora_B"), ad.b.clone()));
        }
    }

    /// The base weight [out, in].
    pub fn weight(&self) -> &Tensor {
        self.base.weight()
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.base.bias()
    }

    /// Whether x takes [`crate::ops::projection::frozen_linear`]: off the CPU, a gradient flowing
    /// through x and none into a weight with contiguous rows.
    fn frozen_under_gradient(&self, x: &Tensor) -> bool {
        crate::ops::projection::takes_frozen(x, self.weight())
    }

    /// Whether x [.., in] takes statecut's differentiable projection: off the CPU, when a
    /// gradient flows through x or the weight, and for a weight whose rows are contiguous (a
    /// column view is not).
    fn trained(&self, x: &Tensor) -> bool {
        x.rank() >= 2
            && !x.device().is_cpu()
            && self.weight().is_contiguous()
            && !crate::ops::untracked(&[x, self.weight()])
    }

    /// The projection of x as `ops::projection::linked_linear` makes it, its output linked to
    /// the one op that reads it, where the forward is one of statecut's products (off the CPU,
    /// a gradient flowing) with no bias or adapter; `None` elsewhere.
    pub(crate) fn forward_linked(&self, x: &Tensor) -> candle_core::Result<Option<crate::ops::link::Linked>> {
        if self.adapter.is_some() || self.bias().is_some() || !(self.frozen_under_gradient(x) || self.trained(x)) {
            return Ok(None);
        }
        let _s = crate::profile::span("projections", x.device());
        crate::ops::projection::linked_linear(x, self.weight()).map(Some)
    }

    /// The weight of a projection that is the base matmul by a frozen weight with contiguous rows
    /// (no bias, no adapter, no gradient): what an op that ends in this projection may multiply
    /// by itself (see `ops::norm::RmsNorm::project_heads`).
    pub fn frozen_weight(&self) -> Option<&Tensor> {
        let w = self.weight();
        (self.adapter.is_none() && self.bias().is_none() && w.is_contiguous() && crate::ops::untracked(&[w]))
            .then_some(w)
    }

    /// Whether the forward is the base matmul alone on tensors that track no gradient: what a
    /// fused or stacked path that reads `weight()` directly may stand in for.
    pub fn is_plain(&self) -> bool {
        self.adapter.is_none() && !self.weight().is_variable()
    }

    /// Output rows `start..start + len` of the base (and its bias), a view.
    pub fn rows(&self, start: usize, len: usize) -> Result<Self> {
        self.no_adapter("rows")?;
        let bias = self.bias().map(|b| b.narrow(0, start, len)).transpose()?;
        Ok(Self::new(self.weight().narrow(0, start, len)?, bias))
    }

    /// Input columns `start..start + len` of the base, a view; the bias, added once per output,
    /// stays with the full projection, so the view has none.
    pub fn cols(&self, start: usize, len: usize) -> Result<Self> {
        self.no_adapter("cols")?;
        Ok(Self::new(self.weight().narrow(1, start, len)?, None))
    }

    /// A view of the base would drop the adapter's part of it silently.
    fn no_adapter(&self, what: &str) -> Result<()> {
        if self.adapter.is_some() {
            bail!("Linear::{what}: a view is of the base weight; merge the adapter first");
        }
        Ok(())
    }

    /// The same projection with `adapter` added to it.
    pub fn with_adapter(self, adapter: Adapter) -> Result<Self> {
        let (out, inp) = self.weight().dims2()?;
        let (ra, ia) = adapter.a.dims2()?;
        let (ob, rb) = adapter.b.dims2()?;
        ensure!(
            ia == inp && ob == out && ra == rb,
            "adapter A {:?}, B {:?} do not fit a weight [{out}, {inp}]",
            adapter.a.dims(),
            adapter.b.dims()
        );
        ensure!(adapter.a.dtype() == DType::F32 && adapter.b.dtype() == DType::F32, "adapter A and B must be float32");
        Ok(Self { adapter: Some(Box::new(adapter)), ..self })
    }

    pub fn adapter(&self) -> Option<&Adapter> {
        self.adapter.as_deref()
    }

    /// W + scale·B·A in the base dtype, computed in float32 (W itself without an adapter).
    pub fn merged(&self) -> Result<Tensor> {
        let w = self.weight();
        let Some(ad) = &self.adapter else { return Ok(w.clone()) };
        Ok((w.to_dtype(DType::F32)? + ad.delta()?)?.to_dtype(w.dtype())?)
    }

    /// The projection with the adapter merged into its base weight.
    pub fn into_merged(self) -> Result<Self> {
        let named = self.named.as_ref().map(|n| Box::new(Named { name: n.name.clone(), var: None }));
        Ok(Self { named, ..Self::new(self.merged()?, self.bias().cloned()) })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let _s = crate::profile::span("projections", x.device());
        let product = if self.frozen_under_gradient(x) {
            // The weight takes no gradient: candle's matmul backward would compute it anyway.
            Some(crate::ops::projection::frozen_linear(x, self.weight())?)
        } else if self.trained(x) {
            // One product over all rows each way, the weight's gradient included, with no
            // reshape in the graph (see `ops::projection`).
            Some(crate::ops::projection::trained_linear(x, self.weight())?)
        } else {
            None
        };
        let y = match (product, self.bias()) {
            (Some(y), Some(b)) => y.broadcast_add(b)?,
            (Some(y), None) => y,
            (None, _) => self.base.forward(x)?,
        };
        let Some(ad) = &self.adapter else { return Ok(y) };
        // (x·Aᵀ)·Bᵀ over the rows of x, in float32: r-wide, never the [out, in] product.
        let dims = x.dims();
        let inp = *dims.last().unwrap_or(&0);
        let xs = x.reshape(((), inp))?.to_dtype(DType::F32)?;
        let d = (xs.matmul(&ad.a.as_tensor().t()?)?.matmul(&ad.b.as_tensor().t()?)? * ad.scale)?;
        let mut out = dims.to_vec();
        *out.last_mut().expect("a matmul input has a last dimension") = d.dim(1)?;
        y + d.reshape(out)?.to_dtype(x.dtype())?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn rand(rng: &mut StdRng, shape: &[usize]) -> Tensor {
        let n = shape.iter().product::<usize>();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1f32..1f32)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(D::Minus1).unwrap().to_scalar().unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
    }

    /// Sizes (out, in, rank, leading dims of x) and a seed for the values.
    fn case() -> impl Strategy<Value = (usize, usize, usize, Vec<usize>, u64)> {
        (1usize..12, 1usize..12, 1usize..5, prop::collection::vec(1usize..4, 1..=3), any::<u64>())
    }

    fn run(name: &str, body: impl Fn((usize, usize, usize, Vec<usize>, u64)) -> Result<(), TestCaseError>) {
        let mut runner = TestRunner::new(Config { cases: 48, failure_persistence: None, ..Config::default() });
        if let Err(e) = runner.run(&case(), body) {
            panic!("{name}: {e}");
        }
    }

    struct Case {
        lin: Linear,
        x: Tensor,
        rng: StdRng,
    }

    fn build(out: usize, inp: usize, lead: &[usize], seed: u64, bias: bool) -> Case {
        let mut rng = StdRng::seed_from_u64(seed);
        let w = rand(&mut rng, &[out, inp]);
        let b = bias.then(|| rand(&mut rng, &[out]));
        let x = rand(&mut rng, &[lead, &[inp]].concat());
        Case { lin: Linear::new(w, b), x, rng }
    }

    fn adapter(rng: &mut StdRng, out: usize, inp: usize, r: usize, scale: f64) -> Adapter {
        let a = Var::from_tensor(&rand(rng, &[r, inp])).unwrap();
        let b = Var::from_tensor(&rand(rng, &[out, r])).unwrap();
        Adapter { a, b, scale }
    }

    /// (a) x through the adapter equals x through the merged weight.
    #[test]
    fn adapter_forward_equals_merged_forward() {
        run("adapter vs merged", |(out, inp, r, lead, seed)| {
            let Case { lin, x, mut rng } = build(out, inp, &lead, seed, seed % 2 == 0);
            let lin = lin.with_adapter(adapter(&mut rng, out, inp, r, 0.5)).unwrap();
            let merged = Linear::new(lin.merged().unwrap(), lin.bias().cloned());
            let d = max_diff(&lin.forward(&x).unwrap(), &merged.forward(&x).unwrap());
            prop_assert!(d < 1e-5, "differs by {d} (out {out}, in {inp}, r {r}, x {:?})", x.dims());
            let d = max_diff(&lin.clone().into_merged().unwrap().forward(&x).unwrap(), &merged.forward(&x).unwrap());
            prop_assert!(d == 0.0, "into_merged differs by {d}");
            Ok(())
        });
    }

    /// (b) An adapter whose B is zero changes no bit of the output.
    #[test]
    fn zero_b_adapter_changes_nothing() {
        run("zero B", |(out, inp, r, lead, seed)| {
            let Case { lin, x, mut rng } = build(out, inp, &lead, seed, true);
            let mut ad = adapter(&mut rng, out, inp, r, 2.0);
            ad.b = Var::zeros((out, r), DType::F32, &Device::Cpu).unwrap();
            let plain = lin.forward(&x).unwrap();
            let adapted = lin.with_adapter(ad).unwrap().forward(&x).unwrap();
            prop_assert_eq!(bits(&plain), bits(&adapted));
            Ok(())
        });
    }

    /// (c) Autograd's gradients of A and B equal central finite differences of
    /// L = Σ forward(x)·g. L is linear in each single entry, so the difference is exact up to
    /// float32 rounding.
    #[test]
    fn adapter_gradients_match_finite_differences() {
        run("gradients", |(out, inp, r, lead, seed)| {
            let Case { lin, x, mut rng } = build(out, inp, &lead, seed, false);
            let ad = adapter(&mut rng, out, inp, r, 0.75);
            let lin = lin.with_adapter(ad.clone()).unwrap();
            let g = rand(&mut rng, &[lead.as_slice(), &[out]].concat());
            let loss = |lin: &Linear| (lin.forward(&x).unwrap() * &g).unwrap().sum_all().unwrap();
            let grads = loss(&lin).backward().unwrap();
            for (name, var) in [("A", &ad.a), ("B", &ad.b)] {
                let got =
                    grads.get(var.as_tensor()).expect("a gradient").flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let base = var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let eps = 0.25f32;
                for (i, &gi) in got.iter().enumerate() {
                    let at = |delta: f32| {
                        let mut v = base.clone();
                        v[i] += delta;
                        var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap()).unwrap();
                        loss(&lin).to_scalar::<f32>().unwrap()
                    };
                    let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                    var.set(&Tensor::from_vec(base.clone(), var.dims(), &Device::Cpu).unwrap()).unwrap();
                    let tol = 1e-3 * (1.0 + fd.abs());
                    prop_assert!((gi - fd).abs() < tol, "d{name}[{i}]: autograd {gi}, finite differences {fd}");
                }
            }
            Ok(())
        });
    }

    /// (d) Row and column views are the matching slices of the full product.
    #[test]
    fn views_are_slices_of_the_full_product() {
        run("views", |(out, inp, _, lead, seed)| {
            let Case { lin, x, .. } = build(out, inp, &lead, seed, true);
            let last = lead.len();
            let full = lin.forward(&x).unwrap();
            let (start, len) = (seed as usize % out, 1 + (seed as usize / 7) % out);
            let len = len.min(out - start);
            let rows = lin.rows(start, len).unwrap().forward(&x).unwrap();
            // Within rounding: the matmul of a narrower weight may block its sums differently.
            let d = max_diff(&rows, &full.narrow(last, start, len).unwrap());
            prop_assert!(d <= 1e-5, "rows {start}..+{len}: {d}");
            // Columns: the products over complementary column ranges sum to the full product.
            let split = seed as usize % (inp + 1);
            let nobias = Linear::new(lin.weight().clone(), None);
            let mut sum = nobias.forward(&x).unwrap().zeros_like().unwrap();
            for (s, l) in [(0, split), (split, inp - split)] {
                if l > 0 {
                    let part = lin.cols(s, l).unwrap();
                    prop_assert!(part.bias().is_none());
                    sum = (sum + part.forward(&x.narrow(last, s, l).unwrap()).unwrap()).unwrap();
                    let want = Linear::new(lin.weight().narrow(1, s, l).unwrap().contiguous().unwrap(), None);
                    let d = max_diff(
                        &part.forward(&x.narrow(last, s, l).unwrap()).unwrap(),
                        &want.forward(&x.narrow(last, s, l).unwrap()).unwrap(),
                    );
                    prop_assert!(d <= 1e-5, "cols {s}..+{l}: {d}");
                }
            }
            let d = max_diff(&sum, &nobias.forward(&x).unwrap());
            prop_assert!(d < 1e-5, "column parts differ from the whole by {d}");
            Ok(())
        });
    }

    /// (e) Without an adapter the forward is candle_nn::Linear's, bit for bit, on 2-D, 3-D and
    /// 4-D inputs (candle takes a different matmul path for each).
    #[test]
    fn plain_forward_is_candles() {
        run("candle parity", |(out, inp, _, lead, seed)| {
            let Case { lin, x, .. } = build(out, inp, &lead, seed, seed % 3 == 0);
            let reference = candle_nn::Linear::new(lin.weight().clone(), lin.bias().cloned());
            prop_assert_eq!(bits(&lin.forward(&x).unwrap()), bits(&reference.forward(&x).unwrap()));
            Ok(())
        });
    }

    /// Trainable: the weight is a variable registered under its checkpoint name, and views and
    /// mismatched adapters are refused rather than silently wrong.
    #[test]
    fn trainable_and_refusals() -> Result<()> {
        let dev = Device::Cpu;
        let mut rng = StdRng::seed_from_u64(1);
        let ts = [("layer.q_proj.weight", &[4, 3][..]), ("layer.q_proj.bias", &[4]), ("layer.k_proj.weight", &[4, 3])];
        let ts = ts.iter().map(|(n, s)| (n.to_string(), rand(&mut rng, s))).collect();
        let vb = VarBuilder::from_tensors(ts, DType::F32, &dev).pp("layer");
        let params = |l: &Linear| {
            let mut out = Vec::new();
            l.params(&mut out);
            out
        };
        let frozen = Linear::load_trainable(&vb, "q_proj", 3, 4, true, false)?;
        assert!(params(&frozen).is_empty() && frozen.is_plain());
        let lin = Linear::load_trainable(&vb, "k_proj", 3, 4, false, true)?;
        let vars = params(&lin);
        assert_eq!(vars.len(), 1);
        assert_eq!(vars[0].0, "layer.k_proj.weight");
        assert!(lin.weight().is_variable() && !lin.is_plain());
        assert_eq!(lin.weight().id(), vars[0].1.as_tensor().id());
        assert!(frozen.clone().with_adapter(adapter(&mut rng, 3, 4, 2, 1.0)).is_err(), "A, B transposed");
        let adapted = frozen.with_adapter(adapter(&mut rng, 4, 3, 2, 1.0))?;
        let names: Vec<String> = params(&adapted).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["layer.q_proj.lora_A", "layer.q_proj.lora_B"]);
        assert!(adapted.rows(0, 2).is_err() && adapted.cols(0, 2).is_err());
        // A view is not a checkpoint tensor: it cannot train and reports nothing.
        assert!(lin.rows(0, 2)?.trainable().is_err());
        Ok(())
    }
}
