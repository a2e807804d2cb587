//! Values a layer makes from stored tensors when it loads (a float32 copy, `1 + w`,
//! `-exp(A_log)`, several convs joined into one). Made once, they would go stale when the tensor is trained: the variable
//! changes between steps while the copy keeps its first value (and its gradient still reaches
//! the variable, so training would drift it blindly). A [`Derived`] of a variable is made again
//! at each use instead.

use candle_core::{Result, Tensor};
use std::sync::Arc;

type Make = Box<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>;

/// Shared by the layer's clones, so as small as a tensor handle.
#[derive(Clone)]
pub struct Derived(Arc<Inner>);

struct Inner {
    stored: Vec<Tensor>,
    value: Tensor,
    make: Make,
}

impl Derived {
    /// `make(stored)`.
    pub fn new(stored: Tensor, make: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static) -> Result<Self> {
        Self::joined(vec![stored], move |s| make(&s[0]))
    }

    /// `make(stored)` of several stored tensors.
    pub fn joined(
        stored: Vec<Tensor>,
        make: impl Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
    ) -> Result<Self> {
        let value = make(&stored)?;
        Ok(Self(Arc::new(Inner { stored, value, make: Box::new(make) })))
    }

    /// The value's shape, which training does not change.
    pub fn shape(&self) -> &candle_core::Shape {
        self.0.value.shape()
    }

    /// The value now: the one made at load, or, when a stored tensor trains, made from them as
    /// they are.
    pub fn get(&self) -> Result<Tensor> {
        let d = &self.0;
        match d.stored.iter().any(Tensor::is_variable) {
            true => (d.make)(&d.stored),
            false => Ok(d.value.clone()),
        }
    }
}

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Derived").field("value", &self.0.value).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// A value made from a variable follows it; one made from a plain tensor is made once.
    #[test]
    fn follows_a_trained_tensor() {
        let dev = Device::Cpu;
        let var = Var::from_tensor(&Tensor::new(&[0f32, 1.0], &dev).unwrap()).unwrap();
        let d = Derived::new(var.as_tensor().clone(), |t| t.exp()?.neg()).unwrap();
        var.set(&Tensor::new(&[1f32, 2.0], &dev).unwrap()).unwrap();
        let got = d.get().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, vec![-(1f32.exp()), -(2f32.exp())]);
        // The gradient reaches the variable through the value made now.
        let g = d.get().unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(g.get(var.as_tensor()).unwrap().to_vec1::<f32>().unwrap(), got);

        // A join follows any of its parts.
        let fixed = Tensor::new(&[5f32], &dev).unwrap();
        let d = Derived::joined(vec![fixed, var.as_tensor().clone()], |s| Tensor::cat(s, 0)).unwrap();
        var.set(&Tensor::new(&[3f32, 4.0], &dev).unwrap()).unwrap();
        assert_eq!(d.get().unwrap().to_vec1::<f32>().unwrap(), vec![5.0, 3.0, 4.0]);

        let plain = Tensor::new(&[0f32, 1.0], &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let d = Derived::new(plain, |t| t.to_dtype(DType::F32)).unwrap();
        assert_eq!(d.get().unwrap().dtype(), DType::F32);
    }
}
