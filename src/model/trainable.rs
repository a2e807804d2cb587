//! Tensors loaded as variables, by checkpoint name: what a loss is differentiated with respect
//! to. The weights' backend is wrapped so that every tensor a selector accepts comes out of the
//! loaders as a [`Var`], whatever layer reads it (projections, short convs, norms, biases, decay
//! parameters), with no change to the layers themselves.

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Which checkpoint tensors load as variables.
pub type Selector = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// The variables of one loaded model, by checkpoint name.
#[derive(Clone, Default)]
pub struct Trainable {
    vars: Arc<Mutex<BTreeMap<String, Var>>>,
    /// The loaded values the variables started from, kept when asked for: a low-rank adapter
    /// trains against its frozen base (see [`Trainable::keeping_bases`]).
    bases: Option<Arc<Mutex<BTreeMap<String, Tensor>>>>,
}

impl Trainable {
    /// A set that also keeps each variable's loaded tensor, frozen, beside the variable.
    pub fn keeping_bases() -> Self {
        Self { bases: Some(Default::default()), ..Default::default() }
    }

    /// The loaded tensors the variables started from (empty unless [`Trainable::keeping_bases`]).
    pub fn bases(&self) -> BTreeMap<String, Tensor> {
        self.bases.as_ref().map(|b| b.lock().expect("trainable set poisoned").clone()).unwrap_or_default()
    }

    /// `weights` with the tensors `select` accepts loaded as variables registered here. A tensor
    /// read twice (a tied head, say) is the same variable both times, so its gradient is whole.
    pub fn wrap(&self, weights: VarBuilder<'static>, select: Selector) -> VarBuilder<'static> {
        let (dtype, device) = (weights.dtype(), weights.device().clone());
        let backend = Tracking { inner: weights, select, vars: self.clone() };
        VarBuilder::from_backend(Box::new(backend), dtype, device)
    }

    /// The variables by checkpoint name.
    pub fn vars(&self) -> BTreeMap<String, Var> {
        self.vars.lock().expect("trainable set poisoned").clone()
    }

    fn track(&self, name: &str, t: Tensor) -> Result<Tensor> {
        let mut vars = self.vars.lock().expect("trainable set poisoned");
        if let Some(v) = vars.get(name).filter(|v| v.shape() == t.shape() && v.dtype() == t.dtype()) {
            return Ok(v.as_tensor().clone());
        }
        let var = Var::from_tensor(&t)?;
        vars.insert(name.to_string(), var.clone());
        if let Some(bases) = &self.bases {
            bases.lock().expect("trainable set poisoned").insert(name.to_string(), t);
        }
        Ok(var.as_tensor().clone())
    }
}

struct Tracking {
    inner: VarBuilder<'static>,
    select: Selector,
    vars: Trainable,
}

impl SimpleBackend for Tracking {
    fn get(&self, s: Shape, name: &str, h: candle_nn::Init, dtype: DType, _: &Device) -> Result<Tensor> {
        let t = self.inner.get_with_hints_dtype(s, name, h, dtype)?;
        if (self.select)(name) {
            self.vars.track(name, t)
        } else {
            Ok(t)
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> Result<Tensor> {
        let t = self.inner.get_unchecked_dtype(name, dtype)?;
        if (self.select)(name) {
            self.vars.track(name, t)
        } else {
            Ok(t)
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}
