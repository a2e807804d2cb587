//! Checkpoint surgery.
