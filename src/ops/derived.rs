//! Values a layer makes from a stored tensor when it loads (a float32 copy, `1 + w`,
//! `-exp(A_log)`). Made once, they would go stale when the tensor is trained: the variable
//! changes between steps while the copy keeps its first value (and its gradient still reaches
//! the variable, so training would drift it blindly). A [`Derived`] of a variable is made again
//! at each use instead.

use candle_core::{Result, Tensor};
use std::sync::Arc;

type Make = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

#[derive(Clone)]
pub struct Derived {
    stored: Tensor,
    value: Tensor,
    make: Make,
}

impl Derived {
    pub fn new(stored: Tensor, make: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static) -> Result<Self> {
        let value = make(&stored)?;
        Ok(Self { stored, value, make: Arc::new(make) })
    }

    /// The value now: the one made at load, or, for a trained tensor, made from it as it is.
    pub fn get(&self) -> Result<Tensor> {
        match self.stored.is_variable() {
            true => (self.make)(&self.stored),
            false => Ok(self.value.clone()),
        }
    }

    /// The tensor as loaded (before the conversion).
    pub fn stored(&self) -> &Tensor {
        &self.stored
    }
}

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Derived").field("value", &self.value).finish_non_exhaustive()
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

        let plain = Tensor::new(&[0f32, 1.0], &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let d = Derived::new(plain, |t| t.to_dtype(DType::F32)).unwrap();
        assert_eq!(d.get().unwrap().dtype(), DType::F32);
    }
}
