//! fla's causal-LM skeleton, shared by every model built from fla blocks (DeltaNet, Gated
//! DeltaNet, SSE): embeddings, then per layer `x + mixer(attn_norm(x))` and
//! `x + mlp(mlp_norm(x))`, a final norm and the LM head (tied to the embeddings or not).

use crate::arch::layered::{Head, Layers, Resident};
use crate::arch::{CausalLm, DecodeCache, LayerCache, LoadOptions, Observer};
use crate::ops::mlp::SwiGlu;
use crate::ops::norm::{NormWeight, RmsNorm};
use crate::profile::mark;
use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use candle_nn::{linear_no_bias, Embedding, Linear, VarBuilder};

/// A block's token mixer (the part under `model.layers.{i}.attn`).
pub trait TokenMixer: Send + Sync {
    fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor>;
}

/// The block-stack shape of a checkpoint.
pub struct StackShape {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub norm_eps: f64,
    pub tie_word_embeddings: bool,
}

struct Block<M> {
    attn_norm: RmsNorm,
    attn: M,
    mlp_norm: RmsNorm,
    mlp: SwiGlu,
}

impl<M: TokenMixer> super::super::layered::Block for Block<M> {
    fn forward(&self, h: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let dev = h.device();
        let x = self.attn_norm.forward(h)?;
        mark("norm", dev);
        let (h, x) = self.mlp_norm.add_forward(h, &self.attn.forward(&x, obs, cache)?)?;
        mark("mixer output + norm", dev);
        let h = (&h + self.mlp.forward(&x)?)?;
        mark("mlp", dev);
        Ok(h)
    }
}

/// Loads layer `i`'s token mixer from its `attn` prefix, registering gradient variables.
pub type MixerLoader<M> = dyn Fn(VarBuilder, usize, &mut Vec<(String, Var)>) -> Result<M> + Send + Sync;

/// The stages of an fla causal LM whose token mixers are `M`.
pub struct FlaLayers<M> {
    vb: VarBuilder<'static>,
    shape: StackShape,
    mixer: Box<MixerLoader<M>>,
    device: Device,
}

impl<M> FlaLayers<M> {
    fn norm(&self, vb: VarBuilder) -> Result<RmsNorm> {
        Ok(RmsNorm::load(vb, self.shape.hidden, self.shape.norm_eps, NormWeight::Plain)?)
    }
}

impl<M: TokenMixer + 'static> Layers for FlaLayers<M> {
    fn num_blocks(&self) -> usize {
        self.shape.layers
    }

    fn embed(&self) -> Result<Embedding> {
        let w = self.vb.pp("model.embeddings").get((self.shape.vocab, self.shape.hidden), "weight")?;
        Ok(Embedding::new(w, self.shape.hidden))
    }

    fn block(&self, i: usize, vars: &mut Vec<(String, Var)>) -> Result<Box<dyn super::super::layered::Block>> {
        let l = self.vb.pp(format!("model.layers.{i}"));
        Ok(Box::new(Block {
            attn_norm: self.norm(l.pp("attn_norm"))?,
            attn: (self.mixer)(l.pp("attn"), i, vars)?,
            mlp_norm: self.norm(l.pp("mlp_norm"))?,
            mlp: SwiGlu::load(l.pp("mlp"), self.shape.hidden, self.shape.intermediate)?,
        }))
    }

    fn head(&self, embed: Option<&Embedding>) -> Result<Head> {
        let s = &self.shape;
        let lm_head = match embed {
            Some(e) if s.tie_word_embeddings => Linear::new(e.embeddings().clone(), None),
            _ if s.tie_word_embeddings => Linear::new(self.embed()?.embeddings().clone(), None),
            _ => linear_no_bias(s.hidden, s.vocab, self.vb.pp("lm_head"))?,
        };
        Ok(Head::new(self.norm(self.vb.pp("model.norm"))?, lm_head))
    }

    fn block_prefix(&self, i: usize) -> String {
        format!("model.layers.{i}.")
    }

    fn embed_name(&self) -> String {
        "model.embeddings.weight".into()
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// An fla causal LM whose token mixers are `M`, every stage loaded.
pub struct FlaStack<M> {
    model: Resident,
    _mixer: std::marker::PhantomData<M>,
}

impl<M: TokenMixer + 'static> FlaStack<M> {
    /// The stages over `vb`; `mixer(vb, layer, vars)` loads layer `layer`'s mixer from `vb` (its
    /// `attn` prefix) and registers any gradient variables in `vars`.
    pub fn layers(
        vb: VarBuilder<'static>,
        s: StackShape,
        opts: &LoadOptions,
        mixer: impl Fn(VarBuilder, usize, &mut Vec<(String, Var)>) -> Result<M> + Send + Sync + 'static,
    ) -> FlaLayers<M> {
        FlaLayers { vb, shape: s, mixer: Box::new(mixer), device: opts.device.clone() }
    }

    /// Every stage of `layers` loaded.
    pub fn from_layers(layers: FlaLayers<M>) -> Result<Self> {
        Ok(Self { model: Resident::load(Box::new(layers))?, _mixer: std::marker::PhantomData })
    }
}

impl<M: TokenMixer> CausalLm for FlaStack<M> {
    fn run(&self, ids: &Tensor, obs: &mut dyn Observer, cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        self.model.run(ids, obs, cache)
    }

    fn grad_vars(&self) -> &[(String, Var)] {
        self.model.grad_vars()
    }

    fn num_blocks(&self) -> usize {
        self.model.num_blocks()
    }

    fn device(&self) -> &Device {
        self.model.device()
    }
}
