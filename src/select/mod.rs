//! Channel selectors.
