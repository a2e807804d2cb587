//! statecut: shrink and inspect the recurrent state of trained linear-attention language models.
//!
//! The library is organised by job and in tiers, each importing only from the tiers below it
//! (docs/ARCHITECTURE.md draws them; `tests/layering.rs` checks them): `hub`/`checkpoint` find
//! and open weights; `ops` holds the math shared by families; `model` the model core (observer,
//! decoding caches, [`model::CausalLm`], stages, load options); `layers` each kind of layer,
//! written once; `arch` one adapter per model family behind [`arch::Family`]; `stream` runs a
//! model layer by layer; `calib`/`select`/`surgery` implement pruning and
//! `eval`/`lambada`/`recall`/`inspect` measure models; `cli` holds the flags and `commands`,
//! `prune`, `bench` and `sweep` the commands built from the rest.

pub mod arch;
pub mod bench;
pub mod bounds;
pub mod calib;
pub mod checkpoint;
pub mod cli;
pub mod commands;
pub mod config_text;
pub mod data;
pub mod device;
pub mod eval;
pub mod graph_decode;
pub mod guard;
pub mod hub;
pub mod inspect;
pub mod lambada;
pub mod layers;
pub mod linalg;
pub mod model;
pub mod ops;
pub mod plot;
pub mod profile;
pub mod progress;
pub mod prune;
pub mod recall;
pub mod recipe;
pub mod recover;
pub mod report;
pub mod select;
pub mod serving;
pub mod signals;
pub mod staging;
pub mod stream;
pub mod surgery;
pub mod sweep;
pub mod torch_save;
