//! A tensor whose gradient goes straight from the op that reads it to the op that made it.
//!
//! candle's backward stores every gradient by adding it into a fresh zero tensor of the
//! tensor's size, so an edge between two of statecut's ops costs a zero fill and an add over
//! the whole tensor even where one op reads it. A linked maker puts out a one-float token in
//! the tensor's place: the token is the graph's edge (its gradient is one float), the tensor
//! goes to its reader untracked, and the reader's backward leaves the tensor's gradient in the
//! link, where the maker's backward takes it. candle runs a maker's backward only after those
//! of every op that reads its output, so the gradient is there when it is taken.
//!
//! Only a reader that knows the link may take the token or the value: any other reader of the
//! value would get no gradient. So makers hand out a [`Linked`], which only such readers take.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Where a reader leaves the gradient of a linked tensor for its maker. Two readers' gradients
/// (or two backwards') add up.
#[derive(Clone, Default)]
pub(crate) struct Link(Arc<Mutex<Option<Tensor>>>);

impl Link {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Option<Tensor>>> {
        self.0.lock().map_err(|_| candle_core::Error::Msg("link: an op panicked holding a gradient".into()))
    }

    /// Leave `g`, the gradient of the linked tensor, for its maker.
    pub fn put(&self, g: Tensor) -> Result<()> {
        let mut slot = self.lock()?;
        let sum = match slot.take() {
            Some(a) => (a + g)?,
            None => g,
        };
        *slot = Some(sum);
        Ok(())
    }

    /// The gradient the readers left, taken out.
    fn take(&self, what: &str) -> Result<Tensor> {
        let taken = self.lock()?.take();
        taken.ok_or_else(|| candle_core::Error::Msg(format!("{what}: no reader left the linked tensor's gradient")))
    }

    /// The gradient a reader's backward hands candle for the token `token` after leaving the
    /// tensor's gradient `g` here: zero, one float.
    pub fn hand_over(&self, token: &Tensor, g: Tensor) -> Result<Tensor> {
        self.put(g)?;
        token.zeros_like()
    }
}

/// A linked maker's output: the tensor itself (untracked), the token that stands for it in the
/// graph, and the link its gradient goes through.
pub(crate) struct Linked {
    pub value: Tensor,
    pub token: Tensor,
    pub link: Link,
}

/// A maker op run linked: its output goes to `value`, a token to the graph.
struct Maker<P> {
    op: P,
    value: Arc<Mutex<Option<Tensor>>>,
    link: Link,
}

impl<P> Maker<P> {
    /// The maker and what `linked` needs once it has run.
    fn new(op: P) -> (Self, Arc<Mutex<Option<Tensor>>>, Link) {
        let (value, link) = (Arc::new(Mutex::new(None)), Link::default());
        (Self { op, value: value.clone(), link: link.clone() }, value, link)
    }

    fn keep_cpu(&self, (s, shape): (CpuStorage, Shape)) -> Result<(CpuStorage, Shape)> {
        self.keep(candle_core::Storage::Cpu(s), shape)?;
        Ok(super::zero_scalar_cpu())
    }

    #[cfg(feature = "cuda")]
    fn keep_gpu(&self, (s, shape): (candle_core::CudaStorage, Shape)) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let dev = s.device().clone();
        self.keep(candle_core::Storage::Cuda(s), shape)?;
        super::zero_scalar_gpu(&dev)
    }

    fn keep(&self, s: candle_core::Storage, shape: Shape) -> Result<()> {
        let t = Tensor::from_storage(s, shape, candle_core::op::BackpropOp::none(), false);
        *self.value.lock().map_err(|_| candle_core::Error::Msg("link: an op panicked".into()))? = Some(t);
        Ok(())
    }
}

/// The [`Linked`] of a maker that put out `token`.
fn linked(token: Tensor, value: Arc<Mutex<Option<Tensor>>>, link: Link) -> Result<Linked> {
    let value = value.lock().map_err(|_| candle_core::Error::Msg("link: an op panicked".into()))?.take();
    let value = value.ok_or_else(|| candle_core::Error::Msg("link: the maker's forward left no output".into()))?;
    Ok(Linked { value, token, link })
}

/// `op` on x, linked. The op's backward must not read its output (it is given the token).
pub(crate) fn link1<P: CustomOp1 + Send + Sync + 'static>(x: &Tensor, op: P) -> Result<Linked> {
    let (maker, value, link) = Maker::new(op);
    linked(x.apply_op1(maker)?, value, link)
}

/// `op` on (x, y), linked (see [`link1`]).
pub(crate) fn link2<P: CustomOp2 + Send + Sync + 'static>(x: &Tensor, y: &Tensor, op: P) -> Result<Linked> {
    let (maker, value, link) = Maker::new(op);
    linked(x.apply_op2(y, maker)?, value, link)
}

/// `op` on (x, y, z), linked (see [`link1`]).
pub(crate) fn link3<P: CustomOp3 + Send + Sync + 'static>(x: &Tensor, y: &Tensor, z: &Tensor, op: P) -> Result<Linked> {
    let (maker, value, link) = Maker::new(op);
    linked(x.apply_op3(y, z, maker)?, value, link)
}

impl<P: CustomOp1> CustomOp1 for Maker<P> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.keep_cpu(self.op.cpu_fwd(x, l)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        self.keep_gpu(self.op.cuda_fwd(x, l)?)
    }

    fn bwd(&self, x: &Tensor, res: &Tensor, _: &Tensor) -> Result<Option<Tensor>> {
        self.op.bwd(x, res, &self.link.take(self.op.name())?)
    }
}

impl<P: CustomOp2> CustomOp2 for Maker<P> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, y: &CpuStorage, yl: &Layout) -> Result<(CpuStorage, Shape)> {
        self.keep_cpu(self.op.cpu_fwd(x, xl, y, yl)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.keep_gpu(self.op.cuda_fwd(x, xl, y, yl)?)
    }

    fn bwd(&self, x: &Tensor, y: &Tensor, res: &Tensor, _: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.op.bwd(x, y, res, &self.link.take(self.op.name())?)
    }
}

impl<P: CustomOp3> CustomOp3 for Maker<P> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        y: &CpuStorage,
        yl: &Layout,
        z: &CpuStorage,
        zl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.keep_cpu(self.op.cpu_fwd(x, xl, y, yl, z, zl)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
        z: &candle_core::CudaStorage,
        zl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.keep_gpu(self.op.cuda_fwd(x, xl, y, yl, z, zl)?)
    }

    fn bwd(
        &self,
        x: &Tensor,
        y: &Tensor,
        z: &Tensor,
        res: &Tensor,
        _: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.op.bwd(x, y, z, res, &self.link.take(self.op.name())?)
    }
}

/// What an op reads first: a tensor of candle's graph, or a linked maker's output.
#[derive(Clone, Copy)]
pub(crate) enum Operand<'a> {
    Tracked(&'a Tensor),
    Linked(&'a Linked),
}

impl Operand<'_> {
    /// The tensor the op reads.
    pub fn value(&self) -> &Tensor {
        match self {
            Operand::Tracked(t) => t,
            Operand::Linked(l) => &l.value,
        }
    }
}

/// What an op made: a tensor of the graph, or one linked to the one op that reads it.
pub(crate) enum Made {
    Tracked(Tensor),
    Linked(Linked),
}

impl Made {
    /// The made tensor as an operand of the op that reads it.
    pub fn operand(&self) -> Operand<'_> {
        match self {
            Made::Tracked(t) => Operand::Tracked(t),
            Made::Linked(l) => Operand::Linked(l),
        }
    }

    /// Its node in the graph: the tensor, or a linked one's token.
    pub fn node(&self) -> &Tensor {
        match self {
            Made::Tracked(t) => t,
            Made::Linked(l) => &l.token,
        }
    }

    /// The tensor of the graph; a linked one has no other reader and is an error here.
    pub fn tracked(self, what: &str) -> candle_core::Result<Tensor> {
        match self {
            Made::Tracked(t) => Ok(t),
            Made::Linked(_) => candle_core::bail!("{what}: a linked output read by an op that does not take the link"),
        }
    }
}

/// An op reading a linked tensor as its first operand: the graph gives it the token, it runs
/// its op on the value, and the op's gradient for the value goes to the link.
struct Reader<P> {
    op: P,
    value: Tensor,
    link: Link,
}

impl<P> Reader<P> {
    fn new(x: &Linked, op: P) -> Self {
        Self { op, value: x.value.clone(), link: x.link.clone() }
    }

    fn cpu<R>(&self, f: impl FnOnce(&CpuStorage, &Layout) -> Result<R>) -> Result<R> {
        super::on_cpu(&self.value, "linked operand", f)
    }

    #[cfg(feature = "cuda")]
    fn gpu<R>(&self, f: impl FnOnce(&candle_core::CudaStorage, &Layout) -> Result<R>) -> Result<R> {
        super::on_gpu(&self.value, "linked operand", f)
    }

    /// The op's gradient for the value, handed to the link; candle gets the token's (zero).
    fn hand_over(&self, token: &Tensor, g: Option<Tensor>) -> Result<Option<Tensor>> {
        g.map(|g| self.link.hand_over(token, g)).transpose()
    }
}

/// `op` on (x, y, z), reading x linked: the op's output is an ordinary node of the graph.
pub(crate) fn read3<P: CustomOp3 + Send + Sync + 'static>(x: &Linked, y: &Tensor, z: &Tensor, op: P) -> Result<Tensor> {
    x.token.apply_op3(y, z, Reader::new(x, op))
}

/// `op` on (x, y), x an operand that may be linked, its output linked in turn (see [`link2`]).
pub(crate) fn link2_from<P: CustomOp2 + Send + Sync + 'static>(x: Operand, y: &Tensor, op: P) -> Result<Linked> {
    match x {
        Operand::Tracked(x) => link2(x, y, op),
        Operand::Linked(l) => link2(&l.token, y, Reader::new(l, op)),
    }
}

/// `op` on (x, y, z), x an operand that may be linked (see [`link2_from`]).
pub(crate) fn link3_from<P: CustomOp3 + Send + Sync + 'static>(
    x: Operand,
    y: &Tensor,
    z: &Tensor,
    op: P,
) -> Result<Linked> {
    match x {
        Operand::Tracked(x) => link3(x, y, z, op),
        Operand::Linked(l) => link3(&l.token, y, z, Reader::new(l, op)),
    }
}

impl<P: CustomOp2> CustomOp2 for Reader<P> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, y: &CpuStorage, yl: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu(|x, xl| self.op.cpu_fwd(x, xl, y, yl))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.gpu(|x, xl| self.op.cuda_fwd(x, xl, y, yl))
    }

    fn bwd(&self, token: &Tensor, y: &Tensor, res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dy) = self.op.bwd(&self.value, y, res, g)?;
        Ok((self.hand_over(token, dx)?, dy))
    }
}

impl<P: CustomOp3> CustomOp3 for Reader<P> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        y: &CpuStorage,
        yl: &Layout,
        z: &CpuStorage,
        zl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu(|x, xl| self.op.cpu_fwd(x, xl, y, yl, z, zl))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
        z: &candle_core::CudaStorage,
        zl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.gpu(|x, xl| self.op.cuda_fwd(x, xl, y, yl, z, zl))
    }

    fn bwd(
        &self,
        token: &Tensor,
        y: &Tensor,
        z: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dy, dz) = self.op.bwd(&self.value, y, z, res, g)?;
        Ok((self.hand_over(token, dx)?, dy, dz))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// x² as a maker, and a reader that sums its input times w: the linked pair gives the
    /// gradient the tracked pair gives, from two readers and over two backwards too, and the
    /// token is one float.
    struct Square;

    impl CustomOp1 for Square {
        fn name(&self) -> &'static str {
            "test-square"
        }
        fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            let x = super::super::cpu_slice(x, l, "square")?;
            Ok((CpuStorage::F32(x.iter().map(|v| v * v).collect()), l.shape().clone()))
        }
        fn bwd(&self, x: &Tensor, _: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
            Ok(Some(((x * 2.0)? * g)?))
        }
    }

    /// Σ value · w, reading its value from the struct and handing its gradient to the link.
    struct Read {
        value: Tensor,
        w: Tensor,
        link: Link,
    }

    impl CustomOp1 for Read {
        fn name(&self) -> &'static str {
            "test-read"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            let s = (&self.value * &self.w)?.sum_all()?.to_scalar::<f32>()?;
            Ok((CpuStorage::F32(vec![s]), Shape::from(())))
        }
        fn bwd(&self, token: &Tensor, _: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
            Ok(Some(self.link.hand_over(token, self.w.broadcast_mul(g)?)?))
        }
    }

    #[test]
    fn a_linked_gradient_equals_the_tracked_one() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::new(&[1f32, -2.0, 3.0], &dev)?)?;
        let (w1, w2) = (Tensor::new(&[0.5f32, 1.0, -1.0], &dev)?, Tensor::new(&[2f32, 0.0, 1.0], &dev)?);
        let tracked = x.as_tensor().apply_op1(Square)?;
        let want = ((&tracked * &w1)?.sum_all()? + (&tracked * &w2)?.sum_all()?)?.backward()?;
        let linked = link1(x.as_tensor(), Square)?;
        assert_eq!(linked.token.elem_count(), 1);
        assert_eq!(linked.value.to_vec1::<f32>()?, tracked.to_vec1::<f32>()?);
        assert!(!linked.value.track_op() && linked.token.track_op());
        let read = |w: &Tensor| {
            linked.token.apply_op1(Read { value: linked.value.clone(), w: w.clone(), link: linked.link.clone() })
        };
        let loss = (read(&w1)? + read(&w2)?)?;
        for pass in 0..2 {
            let got = loss.backward()?;
            let (got, want) = (got.get(x.as_tensor()).unwrap(), want.get(x.as_tensor()).unwrap());
            assert_eq!(got.to_vec1::<f32>()?, want.to_vec1::<f32>()?, "backward {pass}");
        }
        Ok(())
    }

    /// A maker whose reader left no gradient says so rather than handing back zeros.
    #[test]
    fn a_missing_gradient_is_an_error() -> Result<()> {
        let x = Var::from_tensor(&Tensor::new(&[1f32, 2.0], &Device::Cpu)?)?;
        let linked = link1(x.as_tensor(), Square)?;
        let Err(err) = linked.token.backward() else { panic!("a backward with no reader's gradient passed") };
        assert!(err.to_string().contains("no reader left"), "{err}");
        Ok(())
    }
}
