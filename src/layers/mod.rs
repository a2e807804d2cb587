//! The layer library: each kind of layer written once, parameterised by the tensor layouts and
//! switches of the families that use it. Families (`crate::arch`) keep their configs, tensor
//! names and wiring, and build their layers from these parts. Layers are written against the
//! model core (`crate::model`) and import nothing from the families.

pub mod attention;
pub mod block;
pub mod linear;
pub mod linear_attention;
pub mod mamba2;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod sse;
pub mod stack;
