//! The model core: what every loaded model is and how it is run, whatever its family.
//!
//! The layers (`crate::layers`) and the families (`crate::arch`) are written against these
//! types: the observer that sees inside a forward, the decoding caches, the [`CausalLm`]
//! interface and the stages it runs ([`layered`]), how a model is loaded, and the rows a layer
//! reports for its recurrent state ([`RowSlice`]).

mod cache;
mod causal_lm;
mod geometry;
pub mod layered;
mod load;
mod observer;
mod recurrence;
pub mod trainable;

pub use cache::{DecodeCache, LayerCache};
pub use causal_lm::CausalLm;
pub use geometry::{RowSlice, SliceRole};
pub use load::LoadOptions;
pub use observer::{NoObserver, Observer};
pub use recurrence::run_recurrence;
